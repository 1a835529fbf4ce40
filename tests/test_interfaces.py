"""
Every seam's real object and fake provide its zope interface in full
(C{verifyObject}: every method and attribute, with compatible
signatures). The supervisor's behaviour, fake and real, is checked by one
shared contract: tests/engines/test_supervisor_contract.py.
"""

import json
from pathlib import Path

from twisted.internet.defer import ensureDeferred
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyClass, verifyObject

from blazar.config import LiveConfig, parse_config
from blazar.engines.client import EngineClient, IEngineClient
from blazar.engines.hardware import HardwareCensus, IHardwareCensus, IHardwareProbe
from blazar.engines.hints import EngineHints, IEngineHints
from blazar.engines.supervisor import IInstance, Instance, ISupervisor, Supervisor
from blazar.gateway.bench import BenchRecords, IBenchRecords
from blazar.gateway.quota import IQuotas, Quotas
from blazar.gateway.redisquota import RedisQuotas
from blazar.gateway.sessions import ISessions, ISlotBank, Sessions
from blazar.metrics import Metrics
from blazar.models.registry import IModelRegistry, ModelRegistry
from blazar.protocols.keyadmin import IKeyAdmin, ISharedKeys, KeyAdmin
from blazar.storeservice import SharedKeys, StoreService
from blazar.testing import (
    FakeEngineClient,
    FakeInstance,
    FakeNVML,
    FakeSlotBank,
    FakeSupervisor,
    StubEngineClient,
    fake_engine_app,
    fake_process_reactor,
)
from tests.engines.test_hardware import BrokenOnce
from tests.gateway.test_backpressure import Supervisor as ExplainingFailures
from tests.gateway.test_engine_proxy import HealthSupervisor, ScriptedEngines
from tests.gateway.test_operations import StoppingSupervisor
from tests.typed import StubTreq
from tests.web.test_error_table import Failing
from tests.web.test_quota_door import DownQuotas, HeldQuotas
from tests.web.test_stream_failures import FailingSupervisor


class InterfaceTests(SynchronousTestCase):
    def test_quotas(self) -> None:
        """
        The keys' limits: in memory, in Redis (no connection is made until
        a check), and the door tests' fakes. Their behaviour is one
        contract: tests/gateway/test_quota_contract.py.
        """
        clock = MemoryReactorClock()
        self.assertTrue(verifyObject(IQuotas, Quotas(clock)))
        self.assertTrue(verifyObject(IQuotas, RedisQuotas("redis://127.0.0.1:1/0", clock)))
        self.assertTrue(verifyObject(IQuotas, HeldQuotas()))
        self.assertTrue(verifyObject(IQuotas, DownQuotas()))

    def test_engine_clients(self) -> None:
        self.assertTrue(verifyObject(IEngineClient, EngineClient(MemoryReactorClock())))
        self.assertTrue(verifyObject(IEngineClient, FakeEngineClient(StubTreq(fake_engine_app().resource()))))

    def test_engine_client_fakes(self) -> None:
        stub = StubTreq(fake_engine_app().resource())
        self.assertTrue(verifyObject(IEngineClient, StubEngineClient(stub, FakeSupervisor(["m:latest"]))))
        self.assertTrue(verifyObject(IEngineClient, ScriptedEngines()))

    def test_supervisor_fakes_in_tests(self) -> None:
        self.assertTrue(verifyObject(ISupervisor, HealthSupervisor()))
        self.assertTrue(verifyObject(ISupervisor, ExplainingFailures()))
        for fake in (Failing, FailingSupervisor, StoppingSupervisor):
            self.assertTrue(verifyObject(ISupervisor, fake(["m:latest"])))

    def test_control_socket_dependencies(self) -> None:
        reactor = fake_process_reactor()
        self.assertTrue(verifyObject(IEngineHints, EngineHints(list, FakeEngineClient(None).get, reactor, Metrics())))
        self.assertTrue(verifyObject(IHardwareCensus, HardwareCensus(FakeNVML.with_gpus(), reactor)))
        self.assertTrue(verifyObject(IBenchRecords, BenchRecords(None, None, lambda f, *a: f(None, *a), None, float)))
        self.assertTrue(verifyObject(IKeyAdmin, KeyAdmin(None, LiveConfig(parse_config("")), reactor)))
        self.assertTrue(verifyClass(ISessions, Sessions))
        shared = SharedKeys(StoreService(Path("unused.db"), reactor), LiveConfig(parse_config("")), reactor)
        self.assertTrue(verifyObject(ISharedKeys, shared))

    def test_slot_bank_and_hardware_probe_fakes(self) -> None:
        self.assertTrue(verifyObject(ISlotBank, FakeSlotBank()))
        self.assertTrue(verifyObject(IHardwareProbe, FakeNVML.with_gpus()))
        self.assertTrue(verifyObject(IHardwareProbe, BrokenOnce(FakeNVML.with_gpus())))

    def test_registry(self) -> None:
        self.assertTrue(verifyObject(IModelRegistry, ModelRegistry(parse_config(""), fake_process_reactor())))

    def test_supervisors_and_instances(self) -> None:
        # the objects are verified in the contract tests; the classes here
        self.assertTrue(verifyClass(ISupervisor, Supervisor))
        self.assertTrue(verifyClass(ISupervisor, FakeSupervisor))
        self.assertTrue(verifyClass(IInstance, Instance))
        self.assertTrue(verifyClass(IInstance, FakeInstance))
        self.assertTrue(verifyObject(IInstance, FakeInstance("m")))
        self.assertTrue(verifyObject(ISupervisor, FakeSupervisor(["m:latest"])))


class FakeEngineClientTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.app = fake_engine_app("m:latest")
        self.http = StubTreq(self.app.resource())
        self.client = FakeEngineClient(self.http)

    def test_request_reaches_the_fake_engine(self) -> None:
        body = json.dumps({"model": "m", "messages": []}).encode()
        d = ensureDeferred(
            self.client.request(
                "POST",
                "http://engine.invalid/v1/chat/completions",
                body,
                {b"content-type": [b"application/json"]},
                stream=False,
            )
        )
        self.http.flush()
        response = self.successResultOf(d)
        self.assertEqual(response.code, 200)
        content = self.successResultOf(response.content())
        self.assertEqual(json.loads(content)["model"], "m:latest")
        self.assertEqual(self.client.sent, [("POST", "http://engine.invalid/v1/chat/completions")])

    def test_get_status(self) -> None:
        d = ensureDeferred(self.client.get_status("http://engine.invalid/health"))
        self.http.flush()
        self.assertEqual(self.successResultOf(d), 404)  # the fake engine has no /health
        self.successResultOf(ensureDeferred(self.client.close()))
        self.assertTrue(self.client.closed)
