"""
The four surfaces over the real pipeline and the real registry, in memory
(StubTreq), for tests of what a client sees, assembled as the daemon
assembles them (L{blazar.service.build_gateway}).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, cast

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from blazar.config import Config, parse_config
from blazar.engines.client import EngineClient
from blazar.engines.supervisor import Supervisor
from blazar.gateway.admission import Admission
from blazar.gateway.context import RequestContext
from blazar.models.registry import ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.service import build_gateway
from blazar.testing import FakeSupervisor, StubEngineClient, fake_process_reactor
from blazar.web.auth import AuthGate, KeyHolder
from blazar.web.client import context_of
from tests.typed import StubTreq


class Capture(Resource):
    """
    Hands requests on, keeping each (to read its context afterwards), and
    lets them in with C{key} as the site's auth gate would.
    """

    isLeaf = True

    def __init__(self, inner: Resource) -> None:
        super().__init__()
        self._inner = inner
        self.requests: list[Any] = []
        self.key: Any = None

    def render(self, request: Any) -> Any:
        self.requests.append(request)
        context_of(request).key = self.key
        return self._inner.render(request)


class MemoryGateway:
    """
    The surfaces of a gateway serving C{models} (generated GGUFs named
    C{<name>.gguf}) from C{supervisor}, whose children are C{engine_app}
    (a Klein app, e.g. L{blazar.testing.fake_engine_app}).

    @param supervise: Makes the supervisor from the gateway's config,
        registry and reactor, in place of C{supervisor} (the real
        L{blazar.engines.supervisor.Supervisor}, whose children are fakes of
        the reactor's).
    @ivar root: The C{models_dir}, an absolute path.
    @ivar client: A StubTreq client of the whole router.
    @ivar engine: The StubTreq the children are served by.
    """

    def __init__(
        self,
        test: SynchronousTestCase,
        supervisor: FakeSupervisor | None,
        engine_app: Any,
        models: tuple[str, ...] = ("m",),
        config: str = "",
        admission: bool = False,
        supervise: Callable[[Config, ModelRegistry, Any], Any] | None = None,
    ) -> None:
        root = Path(test.mktemp()).absolute()
        for seed, name in enumerate(models):
            make_test_model(root / f"{name}.gguf", seed=seed)
        self.reactor = fake_process_reactor()
        parsed = parse_config(f'models_dir = "{root}"\n{config}')
        self.engine = StubTreq(engine_app.resource())
        self.registry = ModelRegistry(parsed, self.reactor)
        if supervise is not None:
            supervisor = supervise(parsed, self.registry, self.reactor)
        self.root = root
        self.admission = Admission(self.reactor, lambda: parsed) if admission else None
        gateway = build_gateway(
            self.registry,
            cast(Supervisor, supervisor),
            cast(EngineClient, StubEngineClient(self.engine)),
            self.reactor,
            lambda: parsed,
            admission=self.admission,
            wall=lambda: 0.0,
        )
        self.proxy, self.pipeline = gateway.proxy, gateway.pipeline
        router = gateway.router()
        # with [[keys]] in the config, behind the gate that checks them (as the daemon's site is)
        self.capture = Capture(AuthGate(router, KeyHolder(parsed)) if parsed.keys else router)
        self.client = StubTreq(self.capture)
        self._test = test
        # the models are found once, before any request (the registry's first scan)
        test.successResultOf(ensureDeferred(self.registry.refresh()))

    def post(
        self, path: str, body: dict[str, Any], raw: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, bytes]:
        """
        POST C{body} (or C{raw} bytes) and pump until answered: status,
        headers, body bytes.
        """
        d = self.client.request(
            "POST",
            "http://localhost" + path,
            data=raw if raw is not None else json.dumps(body).encode(),
            headers=headers,
        )
        for _ in range(20):
            self.client.flush()
            self.engine.flush()
        response = self._test.successResultOf(d)
        return response.code, response.headers, self._test.successResultOf(response.content())

    def context(self) -> RequestContext:
        """
        The context of the latest request.
        """
        return context_of(self.capture.requests[-1])
