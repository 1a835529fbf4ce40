"""
Ollama's model management endpoints (/api/copy, /api/pull, /api/delete)
render what the shared model operations (L{blazar.gateway.operations})
return and raise: statuses, bodies, and a pull stream's lines.
"""

import json
from pathlib import Path
from typing import Any, Callable, cast

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import parse_config
from blazar.engines.client import EngineClient
from blazar.engines.supervisor import InstanceState, Supervisor
from blazar.gateway.operations import ModelOperations
from blazar.models.hub import HubName, PullError
from blazar.models.registry import ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.service import build_gateway
from blazar.testing import FakeSupervisor, fake_process_reactor
from tests.typed import StubTreq


class BreakingPuller:
    """
    Reports one line, then fails with C{failure}.
    """

    def __init__(self, failure: Exception) -> None:
        self.failure = failure

    async def pull(self, name: HubName, models_dir: Path, progress: Callable[[dict[str, Any]], None]) -> list[Path]:
        progress({"status": "pulling manifest"})
        raise self.failure


class OllamaModelsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = Path(self.mktemp()).absolute()
        make_test_model(self.root / "m.gguf")
        self.reactor = fake_process_reactor()
        registry = ModelRegistry(parse_config(f'models_dir = "{self.root}"'), self.reactor)
        self.supervisor = FakeSupervisor(["m:latest"])
        self.puller = BreakingPuller(PullError("download of x broke after 5 of 10 bytes; pull again to resume", 502))
        operations = ModelOperations(registry, cast(Supervisor, self.supervisor), self.puller, self.reactor)
        surface = build_gateway(
            registry,
            cast(Supervisor, self.supervisor),
            cast(EngineClient, None),
            self.reactor,
            operations=operations,
            wall=lambda: 0.0,
        ).ollama
        self.client = StubTreq(surface.app.resource())

    def call(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, bytes, bytes]:
        d = self.client.request(method, "http://localhost" + path, data=json.dumps(body).encode())
        self.client.flush()
        response = self.successResultOf(d)
        content = self.successResultOf(response.content())
        return response.code, (response.headers.getRawHeaders(b"content-type") or [b""])[0], content

    def test_copy(self) -> None:
        self.assertEqual(self.call("POST", "/api/copy", {"source": "m", "destination": "m2"})[0], 200)
        status, _, data = self.call("POST", "/api/copy", {"source": "m", "destination": "m2"})
        self.assertEqual((status, json.loads(data)), (400, {"error": 'model "m2" already exists; delete it first'}))
        status, _, data = self.call("POST", "/api/copy", {"source": "nope", "destination": "m3"})
        self.assertEqual((status, json.loads(data)), (404, {"error": 'model "nope" not found, try pulling it first'}))

    def test_copy_with_a_remote_listing_an_odd_id(self) -> None:
        """
        A remote's ids are its own (issue 36: C{a"b} from its /v1/models is
        no Ollama name): every copy used to be a 500 once one was listed.
        Copies still work, and copying the remote's model is a 400 that says
        why.
        """
        config = parse_config(
            f'models_dir = "{self.root}"\n[[remotes]]\nname = "peer"\n'
            'base_url = "http://127.0.0.1:9/v1"\nmodels = "*"\n'
        )
        registry = ModelRegistry(config, self.reactor)
        registry.note_listed("peer", ('a"b', "tiny:latest"))
        operations = ModelOperations(registry, cast(Supervisor, self.supervisor), self.puller, self.reactor)
        surface = build_gateway(
            registry,
            cast(Supervisor, self.supervisor),
            cast(EngineClient, None),
            self.reactor,
            operations=operations,
            wall=lambda: 0.0,
        ).ollama
        self.client = StubTreq(surface.app.resource())
        self.assertEqual(self.call("POST", "/api/copy", {"source": "m", "destination": "m2"})[0], 200)
        status, _, data = self.call("POST", "/api/copy", {"source": "m", "destination": "peer:tiny:latest"})
        self.assertEqual(status, 400)
        status, _, data = self.call("POST", "/api/copy", {"source": 'peer:a"b', "destination": "m4"})
        self.assertEqual(status, 400)
        self.assertIn("remote", json.loads(data)["error"])

    def test_delete(self) -> None:
        instance = self.successResultOf(ensureDeferred(self.supervisor.instance_for("m")))
        self.assertEqual(self.call("DELETE", "/api/delete", {"model": "m"})[0], 200)
        self.assertEqual(
            instance.state, InstanceState.DEAD
        )  # stopped and exited before the files went, as a real child
        self.assertFalse((self.root / "m.gguf").exists())
        status, _, data = self.call("DELETE", "/api/delete", {"model": "m"})
        self.assertEqual((status, json.loads(data)), (404, {"error": 'model "m" not found, try pulling it first'}))

    def test_pull_refused_before_any_line_is_a_plain_error(self) -> None:
        for stream in (True, False):
            status, kind, data = self.call("POST", "/api/pull", {"model": "a/b/c/llama3", "stream": stream})
            self.assertEqual((status, kind), (400, b"application/json; charset=utf-8"))
            self.assertIn("hf.co/{user}/{repo}", json.loads(data)["error"])

    def test_pull_failing_after_a_line_ends_the_stream_with_an_error_line(self) -> None:
        status, kind, data = self.call("POST", "/api/pull", {"model": "hf.co/u/r-GGUF"})
        self.assertEqual((status, kind), (200, b"application/x-ndjson"))
        lines = [json.loads(line) for line in data.splitlines()]
        self.assertEqual(
            lines,
            [
                {"status": "pulling manifest"},
                {"error": "download of x broke after 5 of 10 bytes; pull again to resume"},
            ],
        )
        status, _, data = self.call("POST", "/api/pull", {"model": "hf.co/u/r-GGUF", "stream": False})
        self.assertEqual(
            (status, json.loads(data)),
            (502, {"error": "download of x broke after 5 of 10 bytes; pull again to resume"}),
        )
