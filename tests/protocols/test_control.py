"""
The control channel's commands over an in-memory AMP connection
(twisted.test.iosim), against a supervisor on a fake process reactor.
"""

from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.protocols import amp
from twisted.test.iosim import connectedServerAndClient
from twisted.trial.unittest import SynchronousTestCase

from blazar.engines.supervisor import Supervisor
from blazar.models.registry import ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.protocols.control import (
    PROTOCOL_VERSION,
    ControlServer,
    Evict,
    IncompatibleClient,
    Models,
    NothingToEvict,
    Ps,
    Queue,
    ResetBreakers,
    Status,
    Version,
)
from blazar.testing import fake_process_reactor
from tests.typed import not_none


class ControlTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = Path(self.mktemp())
        make_test_model(root / "models" / "m.gguf")
        self.reactor = fake_process_reactor()

        async def probe(url: str) -> int:
            return 200

        self.config_path = root / "config.toml"
        self.config_path.write_text(
            f'models_dir = "{root / "models"}"\n[[keys]]\nname = "root"\nsecret = "root-secret-0123456789"\n'
            '[engines.llamacpp]\nbinary = "/bin/true"\n'
        )
        from blazar.config import LiveConfig, load_config
        from blazar.protocols.keyadmin import KeyAdmin
        from blazar.web.auth import KeyHolder

        # one live config, as the daemon has (blazar.service.assemble)
        live = LiveConfig(load_config(self.config_path))
        config = live.current
        registry = self.registry = ModelRegistry(live, self.reactor)
        self.models = root / "models"
        self.supervisor = Supervisor(live, registry, self.reactor, probe, {}, port_finder=lambda: 5555)
        status = {"version": "x", "uptime": 1.0, "listeners": ["tcp:1"], "engine": "/e", "data_dir": "/d", "loaded": 0}
        self.holder = KeyHolder(live)
        admin = KeyAdmin(self.config_path, live, self.reactor)
        from blazar.gateway.admission import Admission

        self.admission = Admission(self.reactor, lambda: config)
        self.client, self.server, self.pump = connectedServerAndClient(
            lambda: ControlServer(
                self.supervisor,
                registry,
                lambda: status,
                self.reactor,
                None,
                admin,
                self.admission.snapshot,
            ),
            amp.AMP,
        )

    def call(self, command: Any, **kw: Any) -> Any:
        # AMP treats an error that reaches a Deferred with no errback yet as
        # unhandled and drops the connection: collect the result first.
        result: list[Any] = []
        self.client.callRemote(command, **kw).addBoth(result.append)
        self.pump.flush()
        (value,) = result
        d: Deferred[Any] = Deferred()
        d.callback(value)  # a Failure becomes the Deferred's failure
        return d

    def load(self) -> Any:
        return self.successResultOf(ensureDeferred(self.supervisor.instance_for("m")))

    def test_queue(self) -> None:
        import json

        queue = self.admission.queue("m:latest")
        queue.admit(queue.ticket(trace_id="running"), 1)
        queue.admit(queue.ticket(trace_id="waiting", key="k"), 1)
        self.reactor.advance(1.5)
        answer = self.successResultOf(self.call(Queue))
        self.assertFalse(answer["truncated"])
        (model,) = json.loads(answer["queue"])["models"]
        self.assertEqual(model["slots"], {"busy": 1, "total": 1})
        self.assertEqual(model["oldest_wait_ms"], 1500)
        self.assertEqual([(r["trace_id"], r["key"], r["position"]) for r in model["requests"]], [("waiting", "k", 1)])

    def test_queue_listing_fits_an_amp_value(self) -> None:
        import json

        for name in ("a:latest", "b:latest", "c:latest"):
            queue = self.admission.queue(name)
            for i in range(1001):
                # (one key may hold half the queue at most: four keys fill it)
                queue.admit(queue.ticket(trace_id=f"plm-{'x' * 40}-{i}", key=f"{i % 4}" * 40), 1)
        answer = self.successResultOf(self.call(Queue))
        self.assertTrue(answer["truncated"])
        models = json.loads(answer["queue"])["models"]
        self.assertEqual([m["waiting"]["total"] for m in models], [1000, 1000, 1000])
        self.assertTrue(all(0 < len(m["requests"]) < 200 for m in models))
        self.assertLessEqual(len(answer["queue"]), 60_000)

    def test_version(self) -> None:
        self.assertEqual(
            self.successResultOf(self.call(Version, protocol=PROTOCOL_VERSION))["protocol"], PROTOCOL_VERSION
        )
        self.failureResultOf(self.call(Version, protocol=99), IncompatibleClient)
        # the connection survives a declared error
        self.successResultOf(self.call(Status))

    def test_status(self) -> None:
        self.assertEqual(self.successResultOf(self.call(Status))["listeners"], ["tcp:1"])

    def test_ps_and_evict(self) -> None:
        self.assertEqual(self.successResultOf(self.call(Ps))["instances"], [])
        instance = self.load()
        (row,) = self.successResultOf(self.call(Ps))["instances"]
        self.assertEqual(
            (row["model"], row["state"], row["pid"], row["port"]), ("m:latest", "ready", instance.pid, 5555)
        )
        self.assertEqual(row["breaker"], "closed")
        self.failureResultOf(self.call(Evict, key="other"), NothingToEvict)
        self.assertEqual(self.successResultOf(self.call(Evict, key="m"))["evicted"], ["m:latest"])
        self.assertEqual(instance.transport.signals, ["TERM"])
        instance.transport.exit(0)
        self.failureResultOf(self.call(Evict, all=True), NothingToEvict)

    def test_ps_pages(self) -> None:
        from blazar.protocols import control

        self.patch(control, "PAGE", 0)
        self.load()
        page = self.successResultOf(self.call(Ps, offset=0))
        self.assertEqual((page["instances"], page["next_offset"]), ([], 0))

    def test_reset_breakers_and_models(self) -> None:
        self.supervisor.breaker("m:latest").open_until = 1e9
        self.assertEqual(self.successResultOf(self.call(ResetBreakers))["reset"], ["m:latest"])
        self.assertEqual(self.supervisor.breaker("m:latest").state, "closed")
        self.assertEqual([m["name"] for m in self.successResultOf(self.call(Models))["models"]], ["m:latest"])

    def test_model_show_copy_remove(self) -> None:
        from blazar.protocols.control import ModelCopy, ModelError, ModelRemove, ModelShow

        shown = self.successResultOf(self.call(ModelShow, name="m"))
        self.assertEqual((shown["architecture"], shown["context_length"], shown["loaded"]), ("llama", 2048, False))
        self.failureResultOf(self.call(ModelShow, name="nope"), ModelError)
        # a file that is not a GGUF: a declared error, not a dropped connection
        (self.models / "broken.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
        self.successResultOf(ensureDeferred(self.registry.refresh()))
        self.assertIn("broken", str(self.failureResultOf(self.call(ModelShow, name="broken"), ModelError).value))
        self.assertEqual(self.successResultOf(self.call(ModelShow, name="m"))["name"], "m:latest")
        (self.models / "broken.gguf").unlink()
        self.successResultOf(ensureDeferred(self.registry.refresh()))
        self.assertEqual(self.successResultOf(self.call(ModelCopy, source="m", destination="m2:v1"))["name"], "m2:v1")
        self.failureResultOf(self.call(ModelCopy, source="m", destination="m2:v1"), ModelError)
        self.failureResultOf(self.call(ModelCopy, source="m", destination="bad name"), ModelError)
        instance = self.successResultOf(ensureDeferred(self.supervisor.instance_for("m2:v1")))
        d = self.client.callRemote(ModelRemove, name="m2:v1")
        result: list[Any] = []
        d.addBoth(result.append)
        self.pump.flush()
        self.assertEqual(instance.transport.signals, ["TERM"])  # its engine is stopped first
        instance.transport.exit(0)
        self.pump.flush()
        self.assertEqual(result, [{"name": "m2:v1"}])
        names = [m["name"] for m in self.successResultOf(self.call(Models))["models"]]
        self.assertEqual(names, ["m:latest"])

    def test_keys_commands(self) -> None:
        from blazar.protocols.control import KeyError_, KeysAdd, KeysList, KeysRemove, KeysRotate

        (row,) = self.successResultOf(self.call(KeysList))["keys"]
        self.assertEqual((row["name"], row["secret"]), ("root", "...6789"))
        secret = self.successResultOf(self.call(KeysAdd, name="bob", models=["m"]))["secret"]
        self.assertEqual(not_none(self.holder.find(secret.encode())).models, ("m:latest",))
        self.failureResultOf(self.call(KeysAdd, name="bob"), KeyError_)
        new = self.successResultOf(self.call(KeysRotate, name="bob"))["secret"]
        self.assertIsNone(self.holder.find(secret.encode()))
        self.assertIsNotNone(self.holder.find(new.encode()))
        self.failureResultOf(self.call(KeysRotate, name="nobody"), KeyError_)
        self.failureResultOf(self.call(KeysRemove, name="root"), KeyError_)  # bob is scoped
        self.assertEqual(self.successResultOf(self.call(KeysRemove, name="bob"))["name"], "bob")
        self.assertEqual([k.name for k in self.holder.config.keys], ["root"])

    def test_reload_config(self) -> None:
        from blazar.protocols.control import KeyError_, ReloadConfig

        text = self.config_path.read_text()
        self.config_path.write_text('listen = "tcp:2"\nidle_timeout_secs = 5\n' + text)
        self.assertEqual(self.successResultOf(self.call(ReloadConfig))["restart_needed"], ["listen"])
        self.assertEqual(self.supervisor._config.idle_timeout, 5)
        self.config_path.write_text("bogus = 1\n" + text)
        self.failureResultOf(self.call(ReloadConfig), KeyError_)
        self.assertEqual(self.supervisor._config.idle_timeout, 5)  # unchanged

    def test_logs_and_remove_errors(self) -> None:
        from blazar.protocols.control import Logs, ModelError, ModelRemove, UnknownModel

        self.failureResultOf(self.call(Logs, model="nope"), UnknownModel)
        self.assertEqual(self.successResultOf(self.call(Logs, model="m"))["lines"], [])
        self.failureResultOf(self.call(ModelRemove, name="nope"), ModelError)

    def test_unknown_command_keeps_the_connection(self) -> None:
        class Nope(amp.Command):
            commandName = b"Nope"

        self.failureResultOf(self.call(Nope), amp.UnhandledCommand)
        self.successResultOf(self.call(Status))


class LogTests(SynchronousTestCase):
    def test_ring_pages_filters_and_follows(self) -> None:
        from blazar.protocols.control import LogRing

        ring = LogRing(size=5)
        for i in range(7):
            ring({"log_format": "line {i}", "i": i, "model": "m:latest" if i % 2 else None})
        lines, cursor = ring.after(0, None)
        self.assertEqual(lines, ["line 2", "line 3", "line 4", "line 5", "line 6"])  # the last 5 kept
        self.assertEqual(ring.after(cursor, None), ([], cursor))
        lines, _ = ring.after(0, "m:latest")
        self.assertEqual(lines, ["line 3", "line 5"])
        lines, cursor = ring.after(0, None, budget=20)
        self.assertEqual(lines, ["line 2", "line 3"])
        self.assertEqual(ring.after(cursor, None, budget=20)[0], ["line 4", "line 5"])

    def test_ring_escapes_terminal_controls(self) -> None:
        """
        C{blazar logs} prints the ring's lines: a client's (or an engine's)
        escape sequence is text there too (issue 36).
        """
        from blazar.protocols.control import LogRing

        ring = LogRing()
        ring({"log_format": "agent {agent}", "agent": "x\x1b[2Jy\x9b"})
        ring.engine_line("m:latest", "engine \x1b]0;title\x07")
        self.assertEqual(ring.after(0, None)[0], ["agent x\\x1b[2Jy\\x9b", "engine \\x1b]0;title\\x07"])


class PsGPUTests(SynchronousTestCase):
    """
    C{Ps} lists the GPUs of the daemon's latest hardware census on its
    first page, and each instance's GPU memory (planned, and measured once
    NVML has seen the ready child); without a GPU, an empty list and why.
    """

    def connect(self, nvml: Any, model_config: str = "", hardware: bool = True) -> None:
        from blazar.engines.hardware import HardwareCensus

        root = Path(self.mktemp())
        make_test_model(root / "models" / "m.gguf")
        self.reactor = fake_process_reactor()
        self.health = 200

        async def probe(url: str) -> int:
            return self.health

        from blazar.config import parse_config

        config = parse_config(
            f'models_dir = "{root / "models"}"\n[models."m"]\n{model_config}[engines.llamacpp]\nbinary = "/bin/true"\n'
        )
        registry = ModelRegistry(config, self.reactor)
        self.supervisor = Supervisor(config, registry, self.reactor, probe, {}, port_finder=lambda: 5555)
        census = HardwareCensus(nvml, self.reactor)
        census.refresh()
        self.supervisor.hardware = census.fresh
        self.supervisor.on_hardware_change = census.invalidate
        self.supervisor.engine_devices = lambda binary, known: ((str(binary), 0.0), ["CUDA0: fake"])  # a cuda build
        status = {"version": "x", "uptime": 1.0, "listeners": [], "engine": "/e", "data_dir": "/d", "loaded": 0}
        self.client, _, self.pump = connectedServerAndClient(
            lambda: ControlServer(
                self.supervisor, registry, lambda: status, self.reactor, hardware=census if hardware else None
            ),
            amp.AMP,
        )

    def ps(self) -> Any:
        result: list[Any] = []
        self.client.callRemote(Ps).addBoth(result.append)
        self.pump.flush()
        (value,) = result
        return value

    def test_one_gpu(self) -> None:
        from blazar.testing import GIB, FakeNVML

        nvml = FakeNVML.with_gpus(24 * GIB)
        self.connect(nvml)
        self.health = 503
        d = ensureDeferred(self.supervisor.instance_for("m"))
        instance = self.supervisor.instances()[0]
        planned = instance.plan.gpu_bytes[0]
        page = self.ps()
        (gpu,) = page["gpus"]
        self.assertEqual((gpu["index"], gpu["name"], gpu["memory_total"]), (0, "NVIDIA GeForce RTX 4090", 24 * GIB))
        self.assertEqual(gpu["memory_used"] + gpu["memory_free"], gpu["memory_total"])
        self.assertIsNone(page["gpu_note"])  # (an absent optional field reads as None)
        (row,) = page["instances"]
        self.assertEqual((row["vram"], row["gpus"]), (planned, [{"gpu": 0, "planned": planned, "measured": None}]))
        nvml.set_process_memory(not_none(instance.pid), 0, planned + 2**20)
        self.health = 200
        self.reactor.advance(0.05)
        self.successResultOf(d)
        (row,) = self.ps()["instances"]
        self.assertEqual(
            (row["vram"], row["gpus"]), (planned + 2**20, [{"gpu": 0, "planned": planned, "measured": planned + 2**20}])
        )

    def test_two_gpus(self) -> None:
        from blazar.testing import GIB, FakeNVML

        nvml = FakeNVML.with_gpus(24 * GIB, 48 * GIB, name="NVIDIA H100")
        self.connect(nvml, "tensor_split = [1, 1]\n")
        self.successResultOf(ensureDeferred(self.supervisor.instance_for("m")))
        page = self.ps()
        self.assertEqual([(g["index"], g["memory_total"]) for g in page["gpus"]], [(0, 24 * GIB), (1, 48 * GIB)])
        (row,) = page["instances"]
        self.assertEqual([g["gpu"] for g in row["gpus"]], [0, 1])
        self.assertEqual(row["vram"], sum(g["planned"] for g in row["gpus"]))

    def test_no_gpu(self) -> None:
        from blazar.testing import FakeNVML

        self.connect(FakeNVML(gpu_note="NVML unavailable: NVML Shared Library Not Found"))
        self.successResultOf(ensureDeferred(self.supervisor.instance_for("m")))
        page = self.ps()
        self.assertEqual(page["gpus"], [])
        self.assertEqual(page["gpu_note"], "NVML unavailable: NVML Shared Library Not Found")
        (row,) = page["instances"]
        self.assertEqual((row["vram"], row["gpus"]), (0, []))

    def test_no_census_no_gpu_listing(self) -> None:
        from blazar.testing import FakeNVML

        self.connect(FakeNVML(), hardware=False)
        page = self.ps()
        self.assertEqual((page["gpus"], page["gpu_note"]), (None, None))

    def test_a_full_page_on_eight_gpus_fits_an_amp_value(self) -> None:
        from blazar.protocols.control import INSTANCE, PAGE

        row = {
            "model": "hf.co/" + "x" * 90 + ":Q4_K_M",
            "key": "hf.co/" + "x" * 90 + ":Q4_K_M#0@text",
            "state": "ready",
            "pid": 4_000_000,
            "port": 65535,
            "slots": 64,
            "busy": 64,
            "ctx": 1_048_576,
            "expires_in": 1e9,
            "breaker": "half-open",
            "served": 10**12,
            "memory_estimate": 2**45,
            "rss": 2**45,
            "cache_hit": 0.123456789,
            "draft_acceptance": 0.123456789,
            "accepted_per_draft": 12.123456789,
            "speculative": "ngram",
            "kind": "transcription",
            "lane": "a-command-lane-name",
            "vram": 2**45,
            "gpus": [{"gpu": g, "planned": 2**40, "measured": 2**40} for g in range(8)],
        }
        encoded = amp.AmpList(INSTANCE).toStringProto([row] * PAGE, None)
        self.assertLess(len(encoded), 0xFFFF)


class StatusOffTheReactorTests(SynchronousTestCase):
    """
    C{Status} (and C{Ps}'s update line) take a status that answers later:
    the daemon finds its engine binary in a thread (stats and SQLite), not
    on the reactor.
    """

    def test_a_status_that_answers_later(self) -> None:
        from blazar.protocols.control import Status

        later: Deferred[dict[str, Any]] = Deferred()
        root = Path(self.mktemp())
        (root / "models").mkdir(parents=True)
        from blazar.config import parse_config

        reactor = fake_process_reactor()
        config = parse_config(f'models_dir = "{root / "models"}"\n')
        registry = ModelRegistry(config, reactor)

        async def probe(url: str) -> int:
            return 200

        supervisor = Supervisor(config, registry, reactor, probe, {}, port_finder=lambda: 5555)
        client, _, pump = connectedServerAndClient(
            lambda: ControlServer(supervisor, registry, lambda: later, reactor), amp.AMP
        )
        answers: list[Any] = []
        client.callRemote(Status).addBoth(answers.append)
        pump.flush()
        self.assertEqual(answers, [])  # waiting for the thread's answer
        later.callback({"version": "x", "uptime": 1.0, "listeners": [], "engine": "/e", "data_dir": "/d", "loaded": 0})
        pump.flush()
        self.assertEqual(answers[0]["engine"], "/e")
