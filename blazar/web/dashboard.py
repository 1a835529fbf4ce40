"""
The web dashboard (issue 25): C{GET /ui} (and C{GET /} for a browser)
serves a single-page app shipped inside the package (C{blazar/web/ui/}:
plain HTML, CSS and JavaScript, no build step, no CDN: it works offline),
and C{/ui/api/...} the JSON it reads, plus C{GET /api/logs} (the log ring
C{blazar logs} reads, live over Server-Sent Events with C{follow=1}).

Sign-in: the page asks for an API key and keeps it in C{sessionStorage},
sending it as C{Authorization: Bearer} (no cookies, so no CSRF); its
requests go through the same door, scopes and metrics as any client's. On
a gateway without keys the dashboard answers loopback clients only. A
scoped key sees its models (and its own requests) and none of the admin
pages or actions; management (load, unload, evict, breakers, keys) needs
an unscoped key and calls the same code as the AMP verbs
(L{blazar.gateway.operations}, L{blazar.protocols.keyadmin}).

Every response carries a strict Content-Security-Policy (no inline
script or style, nothing from elsewhere), C{X-Frame-Options: DENY} and
C{X-Content-Type-Options: nosniff}.
"""

from __future__ import annotations

from importlib import resources
from typing import Any, Awaitable, Callable

from klein import Klein
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from zope.interface import implementer

from blazar import __version__, strictjson
from blazar.config import Config, ConfigError
from blazar.gateway.call import Call, CallKind
from blazar.gateway.context import key_of
from blazar.gateway.engine_facts import compare, model_kind
from blazar.gateway.errors import BadRequest, Forbidden, Unavailable
from blazar.gateway.operations import ModelOperations, NothingToEvict, gpu_listing
from blazar.gateway.pipeline import Pipeline
from blazar.gateway.scope import may_use, visible_entries
from blazar.models.gguf_meta import GGUFError
from blazar.models.registry import ModelNotFound, ModelRegistry
from blazar.names import strip_dirs
from blazar.protocols.keyadmin import LIMITS as KEY_LIMITS
from blazar.web.auth import check_admin, check_same_machine_page, is_local, ui_headers
from blazar.web.body import read_json
from blazar.web.client import context_of
from blazar.web.errors import answer, openai_error
from blazar.web.ollama import capabilities

log = Logger()

ASSETS = {
    "app.js": b"text/javascript; charset=utf-8",
    "app.css": b"text/css; charset=utf-8",
    "favicon.svg": b"image/svg+xml",
}
LOG_PING = 15.0  # seconds between SSE comments on a quiet log stream (proxies close idle ones)
LOG_POLL = 0.25  # how often a followed log stream looks for new lines
LOG_STALL = 30.0  # a follower that reads nothing this long is disconnected (nothing is buffered for it)
LOG_STREAMS = 8  # followed log streams per key (or per keyless client) at once
secure = ui_headers


def _asset(name: str) -> bytes:
    return resources.files("blazar.web").joinpath("ui", name).read_bytes()


def _viewer(request: IRequest) -> None:
    """
    On a gateway without keys, the dashboard's data is for this machine
    only (as management is: L{check_admin}).

    @raise Forbidden: A keyless request from the network.
    """
    if key_of(context_of(request)) is None and not context_of(request).keys_active:
        if not is_local(request.getClientAddress()):
            raise Forbidden(
                "this gateway has no API keys, so its dashboard answers this machine only; add a key "
                "(`blazar keys add admin`) and sign in with it"
            )
        check_same_machine_page(request, host_too=True)  # not another site's page, not a rebound name


def _is_admin(request: IRequest) -> bool:
    key = key_of(context_of(request))
    return key.admin if key is not None else True  # no key on a keyless gateway (loopback: _viewer)


class Dashboard:
    """
    The dashboard's page, assets and JSON (see the module docstring).
    """

    app = Klein()

    def __init__(
        self,
        registry: ModelRegistry,
        pipeline: Pipeline,
        operations: ModelOperations,
        clock: Any,
        wall: Callable[[], float],
        config: Callable[[], Config],
        logs: Any = None,
        observer: Any = None,
        key_admin: Any = None,
        hints: Any = None,
        engines: Callable[[], Deferred[list[dict[str, Any]]]] | None = None,
        hardware: Any = None,
        bench: Callable[[str | None, int], Awaitable[list[dict[str, Any]]]] | None = None,
        nodes: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        self._nodes = nodes  # blazar.gateway.nodes.ClusterNodes.listing: the cluster's nodes
        self._bench = bench  # blazar.gateway.bench.BenchRecords.history: `blazar bench` runs, newest first
        self._registry = registry
        self._pipeline = pipeline
        self._operations = operations
        self._clock = clock
        self._wall = wall
        self._config = config
        self._logs = logs  # blazar.protocols.control.LogRing
        self.observer = observer  # blazar.web.observe.RequestObserver: activity and performance
        self.key_admin = key_admin  # blazar.protocols.keyadmin.KeyAdmin
        self._hints = hints
        self._engines = engines
        self._hardware = hardware  # blazar.engines.hardware.HardwareCensus: its latest reading's GPUs
        self._streams: dict[str, int] = {}  # followed log streams open, per key (or keyless peer)

    # -- the page ------------------------------------------------------------

    @app.route("/ui", methods=["GET", "HEAD"])
    @app.route("/ui/", methods=["GET", "HEAD"])
    def page(self, request: IRequest) -> bytes:
        secure(request)
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        return _asset("index.html")

    @app.route("/ui/static/<name>", methods=["GET", "HEAD"])
    def static(self, request: IRequest, name: str) -> bytes:
        secure(request)
        kind = ASSETS.get(name)
        if kind is None:
            request.setResponseCode(404)
            request.setHeader(b"content-type", b"text/plain; charset=utf-8")
            return b"no such file"
        request.setHeader(b"content-type", kind)
        request.setHeader(b"cache-control", b"no-cache")
        return _asset(name)

    # -- who is signed in ------------------------------------------------------

    @app.route("/ui/api/door", methods=["GET"])
    def door(self, request: IRequest) -> bytes:
        """
        Open (no key): whether the page must ask for one, so it never
        sends a request bound to be refused.
        """
        return self._json(request, {"keys_active": context_of(request).keys_active})

    @app.route("/ui/api/me", methods=["GET"])
    def me(self, request: IRequest) -> bytes:
        _viewer(request)
        key = key_of(context_of(request))
        return self._json(
            request,
            {
                "key": key.name if key is not None else None,
                "admin": _is_admin(request),
                "keys_active": context_of(request).keys_active,
                "version": __version__,
            },
        )

    # -- models ----------------------------------------------------------------

    @app.route("/ui/api/models", methods=["GET"])
    async def models(self, request: IRequest) -> bytes:
        """
        Files on disk (name, kind, format, size, quantization, trained
        context, capabilities) and loaded instances (L{ModelOperations.instances},
        with the GPUs each holds memory on), each only if the key may use
        it; and the machine's GPUs (L{blazar.gateway.operations.gpu_listing}:
        C{gpus} is C{[]} without one, L{None} before the first hardware
        reading).
        """
        _viewer(request)
        entries = await self._registry.refresh()
        allowed = set(visible_entries(context_of(request), entries))
        files = []
        for e in entries:
            if e.name not in allowed:
                continue
            row: dict[str, Any] = {"name": e.name, "format": e.format, "path": e.path.name}
            if e.remote is not None:  # a [[remotes]] model: nothing of it on this machine
                row.update(kind="remote", size=None, path=f"remote {e.remote}", capabilities=["completion"])
                files.append(row)
                continue
            try:
                meta = await self._registry.metadata(e)
                kind = model_kind(e, meta)
                can = capabilities(e, meta, self._config()) if kind in ("chat", "embedding") else [kind]
                row.update(
                    kind=kind,
                    size=meta.size,
                    architecture=meta.architecture,
                    trained_ctx=meta.context_length,
                    file_type=meta.file_type,
                    capabilities=can,
                )
            except (GGUFError, OSError):
                row.update(kind="unknown", size=None, error="unreadable")
            files.append(row)
        loaded = [r for r in await self._operations.instances(self._hints) if may_use(context_of(request), r["model"])]
        census = self._hardware.latest if self._hardware is not None else None
        return self._json(request, {"files": files, "loaded": loaded, "now": self._wall(), **gpu_listing(census)})

    @app.route("/ui/api/models/<path:name>/load", methods=["POST"])
    async def load(self, request: IRequest, name: str) -> bytes:
        check_admin(request, "load models")
        started, loaded = await self._pipeline.load(context_of(request), Call("ui", CallKind.CHAT, name, "", {}))
        return self._json(request, {"model": context_of(request).model or name, "seconds": round(loaded - started, 3)})

    @app.route("/ui/api/models/<path:name>/unload", methods=["POST"])
    async def unload(self, request: IRequest, name: str) -> bytes:
        check_admin(request, "unload models")
        running = await self._operations.unload(name, "unloaded from the dashboard")
        return self._json(request, {"model": name, "was_running": running})

    @app.route("/ui/api/models/<path:name>/evict", methods=["POST"])
    def evict(self, request: IRequest, name: str) -> bytes:
        check_admin(request, "evict models")
        try:
            return self._json(request, {"evicted": self._operations.evict(name)})
        except NothingToEvict as e:  # not loaded (any more): nothing went wrong
            raise BadRequest(str(e), "model") from None

    @app.route("/ui/api/breakers/reset", methods=["POST"])
    def reset_breakers(self, request: IRequest) -> bytes:
        check_admin(request, "reset crash breakers")
        return self._json(request, {"reset": self._operations.reset_breakers()})

    # -- the cluster's nodes -------------------------------------------------------

    @app.route("/ui/api/nodes", methods=["GET"])
    async def nodes(self, request: IRequest) -> bytes:
        """
        The cluster's nodes as C{blazar cluster --json} lists them
        (L{blazar.gateway.nodes.ClusterNodes.listing}: C{{"clustered",
        "node", "nodes": [{"name", "url", "version", "state", "started",
        "last_seen", "seen_ago", "this", "models": [...]}], "hint"}}), each
        node's models only those the key may use. A scoped (non-admin) key
        gets no C{url} and no C{version}: the nodes' internal addresses
        and the Blazar they run are the operator's. An unreachable shared
        store answers 503 C{store_unavailable}, naming it.
        """
        _viewer(request)
        if self._nodes is None:
            listing: dict[str, Any] = {"clustered": False, "node": "", "nodes": [], "hint": ""}
        else:
            listing = await self._nodes()
        admin = _is_admin(request)
        for node in listing["nodes"]:
            node["models"] = [m for m in node["models"] if may_use(context_of(request), str(m.get("model")))]
            if not admin:
                node.pop("url", None)
                node.pop("version", None)
        return self._json(request, listing)

    # -- activity and performance ------------------------------------------------

    @app.route("/ui/api/activity", methods=["GET"])
    def activity(self, request: IRequest) -> bytes:
        """
        The last requests, newest first (C{limit}, C{model}, C{status}
        filters); a scoped key sees its own requests on its models.
        """
        _viewer(request)
        args = request.args or {}

        def arg(name: str) -> str | None:
            values = args.get(name.encode("ascii"))
            return values[-1].decode("utf-8", "replace") if values else None

        try:
            limit = max(1, min(500, int(arg("limit") or 100)))
        except ValueError:
            raise BadRequest("limit must be a number from 1 to 500", "limit") from None
        key = key_of(context_of(request))
        mine = None if key is None or key.admin else key.name
        rows = (
            self.observer.activity.recent(limit, arg("model"), mine or arg("key"), arg("status"))
            if self.observer is not None
            else []
        )
        return self._json(request, {"requests": [r.to_json() for r in rows if may_use(context_of(request), r.model)]})

    @app.route("/ui/api/performance", methods=["GET"])
    def performance(self, request: IRequest) -> bytes:
        check_admin(request, "see the whole gateway's traffic")
        series = self.observer.performance.series(self._wall()) if self.observer is not None else []
        return self._json(request, {"minutes": series})

    @app.route("/ui/api/bench", methods=["GET"])
    async def bench(self, request: IRequest) -> bytes:
        """
        The runs C{blazar bench} recorded (L{blazar.gateway.bench}), newest
        first, up to 200 (C{model=M}: that model's only), with each
        model's latest run compared with its previous one
        (L{blazar.engines.bench.compare}). Admin: the rows hold every
        model's command line and the machine's hardware.
        """
        check_admin(request, "see the bench history")
        model = (request.args or {}).get(b"model", [b""])[-1].decode("utf-8", "replace") or None
        runs = await self._bench(model, 200) if self._bench is not None else []
        latest: dict[str, list[dict[str, Any]]] = {}
        for run in runs:  # newest first: each model's first two are its latest and previous
            if len(latest.setdefault(run["model"], [])) < 2:
                latest[run["model"]].append(run)
        comparisons = {name: compare(pair[1], pair[0]) for name, pair in latest.items() if len(pair) == 2}
        return self._json(request, {"runs": runs, "comparisons": comparisons})

    # -- logs ------------------------------------------------------------------

    @app.route("/api/logs", methods=["GET"])
    async def logs(self, request: IRequest) -> Any:
        """
        The log ring C{blazar logs} reads: C{model=M} for one model's lines
        (its engine's output and the daemon's events about it; to a scoped
        key, the daemon's events only, paths cut), else the daemon's (admin
        only); C{after=SEQ} for what came later;
        C{follow=1} keeps the response open as Server-Sent Events
        (C{id} is the line's sequence number, C{data} its JSON
        C{{seq, model, text}}).
        """
        _viewer(request)
        args = request.args or {}
        model = args.get(b"model", [b""])[-1].decode("utf-8", "replace") or None
        if model is None:
            check_admin(request, "read the daemon's log")
        else:
            if not may_use(context_of(request), model):
                raise ModelNotFound(model, visible_entries(context_of(request), await self._registry.refresh()))
            model = (await self._registry.resolve(model)).name  # the ring names models canonically
            if not may_use(context_of(request), model):
                raise ModelNotFound(model, visible_entries(context_of(request), await self._registry.refresh()))
        try:
            after = int(args.get(b"after", [b"0"])[-1] or 0)
        except ValueError:
            raise BadRequest("after must be a line number", "after") from None
        follow = args.get(b"follow", [b"0"])[-1] in (b"1", b"true")
        ring = self._logs
        secure(request)
        # a scoped key: Blazar's own lines about its model (loads, unloads,
        # crashes), paths cut; never the engine's raw output, which prints
        # other keys' grammars, schema property names and unparsed answers,
        # nor a request line (it names the key that sent it) (issue 36)
        scoped = not _is_admin(request)

        def lines(since: int) -> list[dict[str, Any]]:
            if ring is None:
                return []
            out = []
            for seq, m, text in list(ring.lines):
                if seq <= since or (model is not None and m != model):
                    continue
                if scoped:
                    if text.startswith(f"{m} | ") or " key=" in text or " trace=" in text:
                        continue
                    text = strip_dirs(text)
                out.append({"seq": seq, "model": m, "text": text})
            return out

        if not follow:
            return self._json(request, {"lines": lines(after)[-2000:]})
        who = key_of(context_of(request))
        owner = who.name if who is not None else f"peer {getattr(request.getClientAddress(), 'host', '')}"
        if self._streams.get(owner, 0) >= LOG_STREAMS:
            raise Forbidden(f"{LOG_STREAMS} log streams are open for {owner} already; close one first")
        return await self._follow(request, lines, after, owner)

    def _follow(
        self, request: IRequest, lines: Callable[[int], list[dict[str, Any]]], after: int, owner: str
    ) -> Deferred[None]:
        """
        Stream the ring's new lines as they come. Nothing is queued for a
        follower that does not read: the transport pauses us (we write
        nothing while paused, and send what the ring still holds once it
        resumes), and one paused for L{LOG_STALL} is disconnected.
        """
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"x-accel-buffering", b"no")
        done: Deferred[None] = Deferred()
        state: dict[str, Any] = {"seq": after, "quiet": 0.0, "paused_at": None}
        self._streams[owner] = self._streams.get(owner, 0) + 1

        @implementer(IPushProducer)
        class Pacer:
            def pauseProducing(self) -> None:
                state["paused_at"] = clock.seconds()

            def resumeProducing(self) -> None:
                state["paused_at"] = None

            def stopProducing(self) -> None:
                finish()

        clock = self._clock
        request.registerProducer(Pacer(), True)  # type: ignore[attr-defined]
        request.write(b": log stream\n\n")

        def tick() -> None:
            if done.called:
                return
            if state["paused_at"] is not None:
                if clock.seconds() - state["paused_at"] >= LOG_STALL:
                    transport = getattr(getattr(request, "channel", None), "transport", None)
                    if transport is not None:
                        transport.abortConnection()  # it reads nothing: drop it, and what it had not read
                    finish()
                    return
            else:
                fresh = lines(state["seq"])
                for line in fresh:
                    request.write(f"id: {line['seq']}\ndata: {strictjson.encode(line)}\n\n".encode("utf-8"))
                    state["seq"] = line["seq"]
                    if state["paused_at"] is not None:
                        break  # the transport's buffer is full: the rest when it drains
                state["quiet"] = 0.0 if fresh else state["quiet"] + LOG_POLL
                if state["quiet"] >= LOG_PING:
                    request.write(b": ping\n\n")
                    state["quiet"] = 0.0
            timer[0] = clock.callLater(LOG_POLL, tick)

        timer = [clock.callLater(0, tick)]

        def finish(_: Any = None) -> None:
            if timer[0].active():
                timer[0].cancel()
            if getattr(request, "producer", None) is not None:
                # before the handler's end finishes the request: Twisted refuses
                # to finish one whose producer is still registered
                try:
                    request.unregisterProducer()  # type: ignore[attr-defined]
                except AttributeError:
                    pass  # the channel is gone already (the client left)
            if not done.called:
                self._streams[owner] -= 1
                if not self._streams[owner]:
                    del self._streams[owner]
                done.callback(None)

        request.notifyFinish().addBoth(finish)  # type: ignore[attr-defined]
        return done

    # -- keys (admin) -------------------------------------------------------------

    @app.route("/ui/api/keys", methods=["GET"])
    def keys(self, request: IRequest) -> bytes:
        check_admin(request, "manage keys")
        if self.key_admin is not None:
            listed = self.key_admin.listed()  # the config file's, then the cluster's shared ones
        else:
            listed = [
                {
                    "name": k.name,
                    "secret": "..." + k.secret[-4:],
                    "models": list(k.models),
                    "admin": k.admin,
                    "rpm": k.rpm,
                    "tpm": k.tpm,
                    "daily_tokens": k.daily_tokens,
                    "shared": False,
                }
                for k in self._config().keys
            ]
        return self._json(
            request,
            {"keys": listed, "config": str(self._config().source) if self._config().source else None},
        )

    @app.route("/ui/api/keys", methods=["POST"])
    async def add_key(self, request: IRequest) -> bytes:
        check_admin(request, "manage keys")
        body = read_json(request)
        name, models = body.get("name"), body.get("models") or []
        if not isinstance(name, str) or not name.strip():
            raise BadRequest("name: the new key's name is required", "name")
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise BadRequest("models: a list of model names (empty: an unscoped key)", "models")
        limits = {}
        for field in KEY_LIMITS:
            value = body.get(field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise BadRequest(f"{field}: a positive number, or null for no limit", field)
            limits[field] = value
        return await self._change(request, lambda admin: admin.add(name.strip(), models, limits), name=name.strip())

    @app.route("/ui/api/keys/<name>/rotate", methods=["POST"])
    async def rotate_key(self, request: IRequest, name: str) -> bytes:
        check_admin(request, "manage keys")
        return await self._change(request, lambda admin: admin.rotate(name), name=name)

    @app.route("/ui/api/keys/<name>", methods=["DELETE"])
    async def remove_key(self, request: IRequest, name: str) -> bytes:
        check_admin(request, "manage keys")
        return await self._change(request, lambda admin: admin.remove(name), name=name)

    async def _change(self, request: IRequest, change: Callable[[Any], Any], **extra: Any) -> bytes:
        if self.key_admin is None:
            raise BadRequest(
                "keys cannot be changed here: the daemon has no config file to write (start it with --config FILE)"
            )
        try:
            result = await self.key_admin.change(change)
        except (ConfigError, ValueError) as e:
            raise BadRequest(str(e)) from None
        except OSError as e:
            # (the error names the server's config path: the log has it, the body does not)
            log.error("a key change could not write the config file: {why}", why=str(e))
            raise Unavailable(
                "the key change could not be written to the config file (the daemon's log says why): "
                "check that the daemon may write the config file's directory"
            ) from None
        return self._json(request, {**extra, **result})

    # -- sessions and engines -------------------------------------------------------

    @app.route("/ui/api/engines", methods=["GET"])
    async def engines(self, request: IRequest) -> bytes:
        check_admin(request, "see the installed engines")
        rows = await self._engines() if self._engines is not None else []
        return self._json(request, {"engines": rows})

    # -- plumbing ---------------------------------------------------------------------

    def _json(self, request: IRequest, value: Any) -> bytes:
        secure(request)
        request.setHeader(b"content-type", b"application/json")
        return strictjson.encode(value).encode("utf-8")

    @app.handle_errors(Exception)
    def _error(self, request: IRequest, failure: Failure) -> bytes | None:
        problem = answer(request, failure.value, "ui")
        if problem is None:
            return None
        secure(request)
        return openai_error(problem)  # the envelope the door's refusals of its requests have
