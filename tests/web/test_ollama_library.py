"""
The Ollama surface over the model store and a registry client: /api/pull
of library names and /api/push stream Ollama's lines (a refusal before the
first is a plain error), /api/tags shows store models as Ollama does.
"""

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, cast

from twisted.trial.unittest import SynchronousTestCase

from blazar.config import parse_config
from blazar.engines.client import EngineClient
from blazar.engines.supervisor import Supervisor
from blazar.gateway.operations import ModelOperations
from blazar.models import ollama_store as store
from blazar.models.ollama_registry import PushError
from blazar.models.ollama_store import OllamaName, parse_name
from blazar.models.registry import ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.service import build_gateway
from blazar.testing import FakeSupervisor, fake_process_reactor
from tests.typed import StubTreq


class ScriptedLibrary:
    """
    A registry client that reports Ollama's lines and records its calls;
    its pulls name a copy of C{source}.
    """

    def __init__(self, source: Path) -> None:
        self.source = source
        self.calls: list[tuple[str, str, bool]] = []
        self.push_failure: Exception | None = None

    async def pull(
        self, name: OllamaName, root: Path, progress: Callable[[dict[str, Any]], None], insecure: bool = False
    ) -> list[Path]:
        self.calls.append(("pull", name.full, insecure))
        progress({"status": "pulling manifest"})
        progress({"status": "success"})
        store.thd_put_model(root, name, self.source)
        return []

    async def push(
        self, name: OllamaName, root: Path, progress: Callable[[dict[str, Any]], None], insecure: bool = False
    ) -> None:
        self.calls.append(("push", name.full, insecure))
        progress({"status": "retrieving manifest"})
        if self.push_failure is not None:
            raise self.push_failure
        progress({"status": "success"})


class LibrarySurfaceTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = Path(self.mktemp()).absolute()
        make_test_model(root / "models" / "m.gguf")
        self.store = root / "store"
        self.gguf = make_test_model(root / "src.gguf", seed=3).path
        self.reactor = fake_process_reactor()
        registry = ModelRegistry(
            parse_config(f'models_dir = "{root / "models"}"\nollama_models = "{self.store}"\n'), self.reactor
        )
        supervisor = FakeSupervisor(["m:latest"])
        self.library = ScriptedLibrary(self.gguf)
        operations = ModelOperations(registry, cast(Supervisor, supervisor), None, self.reactor, self.library)
        surface = build_gateway(
            registry,
            cast(Supervisor, supervisor),
            cast(EngineClient, None),
            self.reactor,
            operations=operations,
            wall=lambda: 0.0,
        ).ollama
        self.client = StubTreq(surface.app.resource())

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes, bytes]:
        d = self.client.request(
            method, "http://localhost" + path, data=json.dumps(body).encode() if body is not None else None
        )
        self.client.flush()
        response = self.successResultOf(d)
        content = self.successResultOf(response.content())
        return response.code, (response.headers.getRawHeaders(b"content-type") or [b""])[0], content

    def test_pull_streams_and_names_the_model(self) -> None:
        status, kind, data = self.call("POST", "/api/pull", {"model": "me/tiny:v1", "insecure": True})
        self.assertEqual((status, kind), (200, b"application/x-ndjson"))
        self.assertEqual(
            [json.loads(line) for line in data.splitlines()], [{"status": "pulling manifest"}, {"status": "success"}]
        )
        self.assertEqual(self.library.calls, [("pull", "registry.ollama.ai/me/tiny:v1", True)])
        status, _, data = self.call("POST", "/api/pull", {"model": "tiny", "stream": False})
        self.assertEqual((status, json.loads(data)), (200, {"status": "success"}))

    def test_tags_show_store_models_as_ollama_does(self) -> None:
        manifest = store.thd_put_model(self.store, parse_name("me/tiny:v1"), self.gguf)
        status, _, data = self.call("GET", "/api/tags")
        models = {m["name"]: m for m in json.loads(data)["models"]}
        tiny = models["me/tiny:v1"]
        self.assertEqual(tiny["digest"], hashlib.sha256(store.manifest_bytes(manifest)).hexdigest())
        self.assertEqual(tiny["size"], sum(d["size"] for d in store.descriptors(manifest)))
        self.assertEqual((tiny["details"]["format"], tiny["details"]["family"]), ("gguf", "llama"))
        self.assertIn("m:latest", models)

    def test_push(self) -> None:
        store.thd_put_model(self.store, parse_name("me/tiny:v1"), self.gguf)
        status, kind, data = self.call("POST", "/api/push", {"model": "me/tiny:v1"})
        self.assertEqual((status, kind), (200, b"application/x-ndjson"))
        self.assertEqual([json.loads(line)["status"] for line in data.splitlines()], ["retrieving manifest", "success"])
        self.assertEqual(self.library.calls, [("push", "registry.ollama.ai/me/tiny:v1", False)])
        self.library.push_failure = PushError("the registry refused", 502)
        status, kind, data = self.call("POST", "/api/push", {"model": "me/tiny:v1"})
        self.assertEqual(
            [json.loads(line) for line in data.splitlines()],
            [{"status": "retrieving manifest"}, {"error": "the registry refused"}],
        )

    def test_push_refusals_are_plain_errors(self) -> None:
        status, _, data = self.call("POST", "/api/push", {"model": "m"})
        self.assertEqual(status, 400)
        self.assertIn("not a model of the Ollama store", json.loads(data)["error"])
        status, _, data = self.call("POST", "/api/push", {"model": "nope"})
        self.assertEqual((status, json.loads(data)), (404, {"error": 'model "nope" not found, try pulling it first'}))
        status, _, data = self.call("POST", "/api/push", {"model": "a/b/c/d"})
        self.assertEqual(status, 400)
        self.assertEqual([c[0] for c in self.library.calls], [])
