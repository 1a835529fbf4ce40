"""
Remotes (C{[[remotes]]}): another server's models served as C{NAME:model}.

A remote is an engine that never spawns: the supervisor hands the request
path a L{RemoteInstance} (always ready, never listed in C{/api/ps}, never
evicted) whose C{base_url} is the remote's and whose C{auth_headers} carry
the remote's key, read at each request (C{api_key_env}). Everything else on
the path is the one a local child's request takes: scope, quotas,
admission (C{max_concurrent} slots), metrics, audit, the relay. A remote
that cannot be reached or answers 5xx counts against its model's breaker,
as a crash does.

The key is only ever in a request header: not in a log line, an error
text (L{scrub}) or C{repr}.
"""

from __future__ import annotations

import json
import re
from typing import Any, Awaitable, Callable, Mapping, TypeGuard

import attrs
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred, succeed
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from blazar.config import Config, RemoteConfig
from blazar.engines.breaker import Breakers
from blazar.metrics import Metrics
from blazar.models.registry import ModelEntry, ModelNotFound
from blazar.names import fair_remote_model

log = Logger()

REMOTE = "remote"  # the lane name of remote models (metrics, instance.lane)
ANTHROPIC_VERSION = b"2023-06-01"


@attrs.define(eq=False)
class RemoteInstance:
    """
    A remote model as the request path sees an engine child (the
    attributes of L{blazar.engines.supervisor.IInstance} that matter to it).

    @ivar entry: The model (C{format = "remote"}).
    @ivar remote: Its remote's config at the time of the request.
    @ivar environ: Where C{api_key_env} is read.
    """

    entry: ModelEntry
    remote: RemoteConfig
    environ: Mapping[str, str] = attrs.field(repr=False, factory=dict)
    state: str = "ready"
    in_flight: int = 0
    served: int = 0
    last_used: float = 0.0
    keep_alive: float | None = None
    unload_when_idle: str | None = None
    stop_reason: str = ""
    ready_once: bool = True
    ready_at: float | None = 0.0
    started_at: float = 0.0
    pid: int | None = None
    port: int = 0
    ctx: int = 0
    lane: str = REMOTE
    kv_bank: bool = False
    health_path: str = "/v1/models"
    path_prefix: str = ""
    shape: str = ""

    @property
    def base_url(self) -> str:
        return self.remote.root

    @property
    def shared(self) -> str:
        """
        What its remote's models share: one breaker and one admission
        queue per remote (L{shared_name}), not per model name.
        """
        return shared_name(self.remote.name)

    @property
    def server(self) -> str:
        # (its URL only in the daemon's log: clients, scoped ones too, learn its name)
        return f"remote {self.remote.name!r}"

    @property
    def api_key(self) -> str:
        return self.remote.key(self.environ) or ""

    @property
    def auth_headers(self) -> dict[bytes, list[bytes]]:
        return auth_headers(self.remote, self.environ)

    def wait_ready(self) -> Deferred[RemoteInstance]:
        return succeed(self)

    def expires_at(self) -> float | None:
        return None


def shared_name(remote: str) -> str:
    """
    The name a remote's breaker and admission queue go by (C{peer:*}):
    every model of one remote shares them (its C{max_concurrent} is the
    remote's, and a remote that is down is down for all its models).
    """
    return f"{remote}:*"


def auth_headers(remote: RemoteConfig, environ: Mapping[str, str]) -> dict[bytes, list[bytes]]:
    """
    The headers that carry the remote's key as its API expects it
    (Anthropic's C{x-api-key} and C{anthropic-version}; a bearer token for
    the others); none without a key.
    """
    headers: dict[bytes, list[bytes]] = {}
    key = remote.key(environ)
    if remote.api == "anthropic":
        headers[b"anthropic-version"] = [ANTHROPIC_VERSION]
        if key:
            headers[b"x-api-key"] = [key.encode("utf-8")]
    elif key:
        headers[b"authorization"] = [b"Bearer " + key.encode("utf-8")]
    return headers


def scrub(text: str, remote: RemoteConfig, environ: Mapping[str, str]) -> str:
    """
    C{text} (a remote's error message, a connection error) without the
    remote's key, should the remote have echoed it (as it is, in any case).
    """
    key = remote.key(environ)
    if key and len(key) >= 4:
        text = re.sub(re.escape(key), "[redacted]", text, flags=re.IGNORECASE)
    return text


def scrub_bytes(data: bytes, remote: RemoteConfig, environ: Mapping[str, str]) -> bytes:
    """
    L{scrub} on the bytes of an answer the remote sent (its JSON, its
    stream's events).
    """
    key = remote.key(environ)
    if key and len(key) >= 4:
        data = re.sub(re.escape(key.encode("utf-8")), b"[redacted]", data, flags=re.IGNORECASE)
    return data


def listed_models(body: bytes) -> tuple[str, ...]:
    """
    The model names in a C{GET /v1/models} answer (OpenAI's, Anthropic's
    and Ollama's C{/v1} shape: C{data[].id}), or Ollama's C{/api/tags}
    (C{models[].name}).

    @raise ValueError: Neither shape.
    """
    answer = json.loads(body)
    if isinstance(answer, dict) and isinstance(answer.get("data"), list):
        items, field = answer["data"], "id"
    elif isinstance(answer, dict) and isinstance(answer.get("models"), list):
        items, field = answer["models"], "name"
    else:
        raise ValueError("not a model list (no data[] or models[])")
    # (another Blazar lists its speech, image and rerank models too: remotes serve chat and embeddings)
    names = [
        item.get(field)
        for item in items
        if isinstance(item, dict) and item.get("kind") not in ("transcription", "image", "rerank")
    ]
    return tuple(sorted({n for n in names if isinstance(n, str) and "*" not in n and fair_remote_model(n)}))


def models_url(remote: RemoteConfig) -> str:
    """
    Where a remote lists its models.
    """
    return remote.root + "/v1/models" + ("?limit=1000" if remote.api == "anthropic" else "")


def is_remote(instance: Any) -> TypeGuard[RemoteInstance]:
    return isinstance(instance, RemoteInstance)


def failure_text(error: BaseException) -> str:
    """
    What a failed HTTP request to a remote says: the reasons inside
    Twisted's wrappers (C{ResponseNeverReceived}, C{NotDelivered}).
    """
    inner = getattr(error, "error", None)
    if isinstance(inner, BaseException):
        error = inner
    reasons = getattr(error, "reasons", None)
    if reasons:
        return "; ".join(str(getattr(r, "value", r)) for r in reasons)[:500]
    return (str(error) or type(error).__name__)[:500]


@attrs.define(eq=False)
class Remotes:
    """
    The instances of remote models: one always-ready instance each, never
    spawned; a failure counts against the breaker its remote's models
    share (L{shared_name}), as a crash does.

    @ivar _breakers: The supervisor's breakers.
    @ivar _environ: The daemon's environment (the remotes' keys, scrubbed
        from what is logged).
    """

    _config: Callable[[], Config]
    _clock: Any
    _breakers: Breakers
    _environ: Mapping[str, str]
    _metrics: Metrics
    _remotes: dict[str, RemoteInstance] = attrs.field(factory=dict)

    def instance(self, entry: ModelEntry) -> RemoteInstance:
        """
        The instance of a remote model, with its remote's config as it is
        now; its breaker checked as a start's is.

        @raise ModelNotFound: Its remote is no longer configured.
        @raise blazar.engines.errors.BreakerOpen: The remote failed too
            often lately.
        """
        remote = self._config().remote(entry.remote or "")
        if remote is None:
            raise ModelNotFound(entry.name, [])
        self._breakers.check(
            shared_name(remote.name),
            lambda crashes, wait: (
                f"remote {remote.name!r} failed {crashes} times lately; Blazar tries it again in {wait} s"
            ),
        )
        instance = self._remotes.get(entry.name)
        if instance is None:
            if len(self._remotes) > 4096:
                self._remotes = {n: i for n, i in self._remotes.items() if i.in_flight}
            instance = self._remotes[entry.name] = RemoteInstance(entry, remote, self._environ)
        instance.remote = remote
        return instance

    def failed(self, instance: RemoteInstance, error: str) -> str:
        """
        A remote could not be reached, timed out or answered 5xx: counted
        against its model's breaker, as a crash is.

        @return: C{error} without the remote's key.
        """
        error = scrub(error, instance.remote, self._environ)
        self._metrics.crashes.labels(instance.shared).inc()
        self._breakers.of(instance.shared).crashed(self._clock.seconds(), error)
        log.warn(
            "{model}: {server} ({url}) failed: {error}",
            model=instance.entry.name,
            server=instance.server,
            url=instance.remote.root,
            error=error,
        )
        return error

    def ok(self, instance: RemoteInstance) -> None:
        """
        A remote answered: a half-open breaker closes.
        """
        self._breakers.of(instance.shared).ready()


@attrs.define(eq=False)
class RemoteCatalog:
    """
    Asks each remote with C{models = "*"} what it serves
    (C{GET /v1/models}) at start and every C{interval} seconds, and tells
    the registry (L{blazar.models.registry.ModelRegistry.note_listed}), so
    C{/v1/models} and C{/api/tags} list C{NAME:model} for each. A remote that
    does not answer keeps its last list; resolving C{NAME:anything} does not
    wait for this (the remote's own answer decides).

    @ivar get: The engine client's C{get(url, headers, timeout)}.
    @ivar note: Where each list goes: C{note(remote name, names)}.
    """

    config: Callable[[], Config]
    get: Callable[..., Awaitable[tuple[int, bytes]]]
    note: Callable[[str, tuple[str, ...]], None]
    clock: Any
    environ: Mapping[str, str] = attrs.field(repr=False, factory=dict)
    interval: float = 60.0
    again: float = 10.0  # seconds between two questions to one remote for a name it did not list
    _job: LoopingCall | None = None
    _failing: set[str] = attrs.field(factory=set)
    _asked: dict[str, float] = attrs.field(factory=dict)  # remote -> when it was last asked
    _asking: dict[str, list[Deferred[None]]] = attrs.field(factory=dict)

    def start(self) -> None:
        self._job = LoopingCall(self._tick)
        self._job.clock = self.clock
        self._job.start(self.interval, now=True).addErrback(lambda f: log.failure("remote catalog stopped", f))

    def stop(self) -> None:
        if self._job is not None and self._job.running:
            self._job.stop()

    def _tick(self) -> Deferred[None]:
        d = ensureDeferred(self.refresh())
        d.addErrback(lambda f: log.failure("asking the remotes for their models failed", f))
        return d

    async def relist(self, name: str) -> None:
        """
        Ask remote C{name} for its list now, for a model name it did not
        list (a model it has just pulled): at most once every L{again}
        seconds, one question for all who ask meanwhile; never raises.
        """
        remote = self.config().remote(name)
        if remote is None or not remote.any_model:
            return
        waiting = self._asking.get(remote.name)
        if waiting is not None:
            d: Deferred[None] = Deferred()
            waiting.append(d)
            await d
            return
        if self.clock.seconds() - self._asked.get(remote.name, float("-inf")) < self.again:
            return
        self._asking[remote.name] = []
        try:
            await self._ask(remote)
        finally:
            for d in self._asking.pop(remote.name):
                d.callback(None)

    async def refresh(self) -> None:
        """
        Ask every C{models = "*"} remote once (a job body: never raises for
        one remote's failure).
        """
        for remote in self.config().remotes:
            if remote.any_model:
                await self._ask(remote)

    async def _ask(self, remote: RemoteConfig) -> None:
        """
        One question to C{remote} for its models; a failure is logged once
        until it answers again.
        """
        self._asked[remote.name] = self.clock.seconds()
        try:
            status, body = await self.get(models_url(remote), auth_headers(remote, self.environ), 10.0)
            if status != 200:
                raise ValueError(f"status {status}")
            names = listed_models(body)
        except CancelledError:
            raise
        except Exception as e:
            if remote.name not in self._failing:
                self._failing.add(remote.name)
                log.warn(
                    'remote {remote}: could not list its models ({error}); with models = "*" they are '
                    "served once it answers",
                    remote=remote.name,
                    error=scrub(str(e) or type(e).__name__, remote, self.environ)[:300],
                )
            return
        self._failing.discard(remote.name)
        self.note(remote.name, names)
