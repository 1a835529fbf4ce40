"""
The model operations (L{blazar.gateway.operations}) against a real registry
on a temporary models_dir, the supervisor fake of L{blazar.testing} and a
scripted puller; eviction against the real supervisor on a fake process
reactor (the fake has no instance key matching).
"""

from pathlib import Path
from typing import Any, Callable, cast

import attrs
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import parse_config
from blazar.engines.supervisor import Supervisor
from blazar.gateway.operations import ModelOperations, NothingToEvict, Pulled
from blazar.models.hub import HubName, PullError
from blazar.models.registry import ModelChangeError, ModelNotFound, ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.testing import FakeInstance, FakeSupervisor, fake_process_reactor


@attrs.define
class StoppingSupervisor(FakeSupervisor):
    """
    L{FakeSupervisor} whose stops end when the test says: each
    C{stop_instance} records (model, reason, whether the model's file was
    still there) and returns a Deferred in C{exits}.
    """

    models_dir: Path = Path("/nonexistent")
    stops: list[tuple[str, str, bool]] = attrs.field(factory=list)
    exits: list[Deferred[None]] = attrs.field(factory=list)

    def stop_instance(self, instance: FakeInstance, reason: str = "requested") -> Any:
        super().stop_instance(instance, reason)
        self.stops.append((instance.name, reason, (self.models_dir / "m.gguf").exists()))
        d: Deferred[None] = Deferred()
        self.exits.append(d)
        return d


@attrs.define
class ScriptedPuller:
    """
    A puller that reports C{lines}, advances C{clock} by C{seconds}, then
    writes a test model for the name (or raises C{failure}).
    """

    clock: Any
    lines: list[dict[str, Any]] = attrs.field(
        factory=lambda: [
            {"status": "pulling manifest"},
            {"status": "pulling 0123456789ab", "digest": "sha256:0123", "total": 10, "completed": 0},
            {"status": "pulling 0123456789ab", "digest": "sha256:0123", "total": 10, "completed": 10},
            {"status": "success"},
        ]
    )
    seconds: float = 2.5
    failure: Exception | None = None
    calls: list[tuple[HubName, Path]] = attrs.field(factory=list)

    async def pull(self, name: HubName, models_dir: Path, progress: Callable[[dict[str, Any]], None]) -> list[Path]:
        self.calls.append((name, models_dir))
        for line in self.lines[:-1]:
            progress(line)
        self.clock.advance(self.seconds)
        if self.failure is not None:
            raise self.failure
        target = models_dir / "hf.co" / name.user / name.repo / f"{name.tag}.gguf"
        make_test_model(target)
        progress(self.lines[-1])
        return [target]


class OperationsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = Path(self.mktemp()).absolute()
        self.models = self.root / "models"
        make_test_model(self.models / "m.gguf")
        make_test_model(self.root / "elsewhere.gguf")
        self.reactor = fake_process_reactor()
        config = parse_config(
            f'models_dir = "{self.models}"\n[models."outside"]\npath = "{self.root / "elsewhere.gguf"}"\n'
        )
        self.registry = ModelRegistry(config, self.reactor)
        self.supervisor = StoppingSupervisor(["m:latest", "outside:latest"], models_dir=self.models)
        self.puller = ScriptedPuller(self.reactor)
        self.operations = ModelOperations(self.registry, cast(Supervisor, self.supervisor), self.puller, self.reactor)

    def call(self, coroutine: Any) -> Deferred[Any]:
        return ensureDeferred(coroutine)

    def names(self) -> list[str]:
        return [e.name for e in self.successResultOf(ensureDeferred(self.registry.refresh()))]

    def load(self, name: str) -> FakeInstance:
        return self.successResultOf(ensureDeferred(self.supervisor.instance_for(name)))

    # -- delete --------------------------------------------------------------

    def test_delete_stops_the_running_engine_before_the_files_go(self) -> None:
        self.load("m")
        d = self.call(self.operations.delete("M"))
        # the engine is told to stop while the file is still there, and the
        # file stays until the engine has exited
        self.assertEqual(self.supervisor.stops, [("m:latest", "model deleted", True)])
        self.assertNoResult(d)
        self.assertTrue((self.models / "m.gguf").exists())
        self.supervisor.exits[0].callback(None)
        self.assertEqual(self.successResultOf(d), "m:latest")
        self.assertFalse((self.models / "m.gguf").exists())
        self.assertNotIn("m:latest", self.names())

    def test_delete_of_a_model_not_running(self) -> None:
        self.assertEqual(self.successResultOf(self.call(self.operations.delete("m:latest"))), "m:latest")
        self.assertEqual(self.supervisor.stops, [])
        self.assertFalse((self.models / "m.gguf").exists())

    def test_delete_of_an_unknown_model(self) -> None:
        self.load("m")
        failure = self.failureResultOf(self.call(self.operations.delete("nope")), ModelNotFound)
        self.assertIn("'nope' not found; available models: m:latest, outside:latest", str(failure.value))
        self.assertEqual(self.supervisor.stops, [])
        self.assertTrue((self.models / "m.gguf").exists())

    def test_delete_refused_stops_nothing(self) -> None:
        self.load("outside")
        failure = self.failureResultOf(self.call(self.operations.delete("outside")), ModelChangeError)
        self.assertIn("remove it from the config instead", str(failure.value))
        self.assertEqual(self.supervisor.stops, [])
        self.assertIsNotNone(self.supervisor.loaded("outside:latest"))
        self.assertTrue((self.root / "elsewhere.gguf").exists())

    # -- copy ----------------------------------------------------------------

    def test_copy(self) -> None:
        self.assertEqual(self.successResultOf(self.call(self.operations.copy("m", "alias:v1"))), "alias:v1")
        self.assertIn("alias:v1", self.names())
        self.assertEqual((self.models / "alias:v1.gguf").stat().st_ino, (self.models / "m.gguf").stat().st_ino)

    def test_copy_onto_an_existing_name(self) -> None:
        self.successResultOf(self.call(self.operations.copy("m", "alias")))
        failure = self.failureResultOf(self.call(self.operations.copy("outside", "Alias:latest")), ModelChangeError)
        self.assertEqual(str(failure.value), 'model "Alias:latest" already exists; delete it first')
        # the existing one is untouched
        self.assertEqual((self.models / "alias.gguf").stat().st_ino, (self.models / "m.gguf").stat().st_ino)

    def test_copy_refusals(self) -> None:
        self.failureResultOf(self.call(self.operations.copy("nope", "alias")), ModelNotFound)
        failure = self.failureResultOf(self.call(self.operations.copy("m", "ns/alias")), ModelChangeError)
        self.assertIn("plain name[:tag]", str(failure.value))
        self.assertEqual(self.names(), ["m:latest", "outside:latest"])

    # -- unload --------------------------------------------------------------

    def test_unload(self) -> None:
        self.load("m")
        d = self.call(self.operations.unload("m", "keep_alive 0"))
        self.assertNoResult(d)  # until the engine has exited
        self.supervisor.exits[0].callback(None)
        self.assertIs(self.successResultOf(d), True)
        self.assertEqual(self.supervisor.stops, [("m:latest", "keep_alive 0", True)])
        self.assertIs(self.successResultOf(self.call(self.operations.unload("m"))), False)
        self.failureResultOf(self.call(self.operations.unload("nope")), ModelNotFound)

    # -- pull ----------------------------------------------------------------

    def test_pull_reports_progress_and_serves_the_model(self) -> None:
        self.names()  # a listing cached before the pull
        lines: list[dict[str, Any]] = []
        pulled = self.successResultOf(self.call(self.operations.pull("hf.co/someone/tiny-GGUF:Q4_K_M", lines.append)))
        self.assertEqual(lines, self.puller.lines)
        target = self.models / "hf.co" / "someone" / "tiny-GGUF" / "Q4_K_M.gguf"
        self.assertEqual(pulled, Pulled("hf.co/someone/tiny-GGUF:Q4_K_M", (target,), 2.5))
        self.assertEqual(self.puller.calls, [(HubName("someone", "tiny-GGUF", "Q4_K_M"), self.models)])
        entry = self.successResultOf(ensureDeferred(self.registry.resolve("hf.co/someone/tiny-GGUF:Q4_K_M")))
        self.assertEqual(entry.path, target)

    def test_pull_without_progress(self) -> None:
        pulled = self.successResultOf(self.call(self.operations.pull("hf.co/someone/tiny-GGUF")))
        self.assertEqual(pulled.name, "hf.co/someone/tiny-GGUF:latest")

    def test_pull_of_a_name_neither_source_takes_is_refused_before_any_progress(self) -> None:
        lines: list[dict[str, Any]] = []
        failure = self.failureResultOf(self.call(self.operations.pull("a/b/c/llama3", lines.append)), PullError)
        self.assertEqual(failure.value.status, 400)
        self.assertIn("hf.co/{user}/{repo}[:{quant}]", str(failure.value))
        self.assertEqual((lines, self.puller.calls), ([], []))

    def test_a_library_name_without_a_registry_client_is_refused_before_any_progress(self) -> None:
        lines: list[dict[str, Any]] = []
        failure = self.failureResultOf(self.call(self.operations.pull("llama3", lines.append)), PullError)
        self.assertEqual(failure.value.status, 501)
        self.assertEqual((lines, self.puller.calls), ([], []))

    def test_failed_pull(self) -> None:
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(cast(ILogObserver, events.append))
        self.addCleanup(globalLogPublisher.removeObserver, cast(ILogObserver, events.append))
        self.puller.failure = PullError("download of x broke; pull again to resume", 502)
        lines: list[dict[str, Any]] = []
        failure = self.failureResultOf(
            self.call(self.operations.pull("hf.co/someone/tiny-GGUF", lines.append)), PullError
        )
        self.assertEqual((failure.value.status, lines), (502, self.puller.lines[:-1]))
        (logged,) = [e for e in events if e.get("log_namespace") == "blazar.gateway.operations"]
        self.assertEqual((logged["model"], logged["error"]), ("hf.co/someone/tiny-GGUF", str(failure.value)))

    def test_pull_without_a_puller(self) -> None:
        operations = ModelOperations(self.registry, cast(Supervisor, self.supervisor), None, self.reactor)
        failure = self.failureResultOf(self.call(operations.pull("hf.co/someone/tiny-GGUF")), PullError)
        self.assertEqual(failure.value.status, 501)


class EvictTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = Path(self.mktemp()).absolute()
        for name in ("a", "b"):
            make_test_model(root / f"{name}.gguf")
        config = parse_config(f'models_dir = "{root}"\n[engines.llamacpp]\nbinary = "/bin/true"\n')
        self.reactor = fake_process_reactor()

        async def probe(url: str) -> int:
            return 200

        registry = ModelRegistry(config, self.reactor)
        ports = iter(range(5555, 5600))
        self.supervisor = Supervisor(config, registry, self.reactor, probe, {}, port_finder=lambda: next(ports))
        self.operations = ModelOperations(registry, self.supervisor, None, self.reactor)

    def load(self, name: str) -> Any:
        return self.successResultOf(ensureDeferred(self.supervisor.instance_for(name)))

    def test_evict_by_key(self) -> None:
        a, b = self.load("a"), self.load("b")
        self.assertEqual(self.operations.evict("a#0@text"), ["a:latest"])
        self.assertEqual((a.transport.signals, b.transport.signals), (["TERM"], []))
        a.transport.exit(0)

    def test_evict_everything(self) -> None:
        a, b = self.load("a"), self.load("b")
        self.assertEqual(sorted(self.operations.evict(everything=True)), ["a:latest", "b:latest"])
        self.assertEqual((a.transport.signals, b.transport.signals), (["TERM"], ["TERM"]))
        a.transport.exit(0)
        b.transport.exit(0)
        with self.assertRaises(NothingToEvict) as raised:
            self.operations.evict(everything=True)
        self.assertEqual(str(raised.exception), "nothing is loaded")

    def test_nothing_to_evict(self) -> None:
        self.load("a")
        with self.assertRaises(NothingToEvict) as raised:
            self.operations.evict("b")
        self.assertEqual(str(raised.exception), "no loaded instance matches 'b'; `blazar ps` lists the loaded ones")
        with self.assertRaises(NothingToEvict):
            self.operations.evict("a#1")
        with self.assertRaises(NothingToEvict):
            self.operations.evict(None)
