"""
Ollama's C{/api/blobs}, C{/api/create} and C{/api/show} on the Ollama
surface, over a real store in a temporary directory (StubTreq, a fake
reactor): statuses, the create stream's lines, and what C{/api/show}
shows of a created model, as Ollama shapes it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, cast

from twisted.trial.unittest import SynchronousTestCase

from blazar.config import parse_config
from blazar.engines.client import EngineClient
from blazar.engines.supervisor import Supervisor
from blazar.gateway.operations import ModelOperations
from blazar.models.create import ModelCreator
from blazar.models.modelfile import parse
from blazar.models.registry import ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.service import build_gateway
from blazar.testing import FakeSupervisor, fake_process_reactor
from tests.typed import StubTreq


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class CreateSurfaceTests(SynchronousTestCase):
    def setUp(self) -> None:
        base = Path(self.mktemp()).absolute()
        self.models, self.root = base / "models", base / "store"
        self.model = make_test_model(self.models / "base.gguf").path
        self.reactor = fake_process_reactor()
        self.registry = ModelRegistry(
            parse_config(f'models_dir = "{self.models}"\nollama_models = "{self.root}"'), self.reactor
        )
        self.supervisor = FakeSupervisor(["base:latest", "mine:latest"])
        creator = ModelCreator(self.registry, self.reactor, lambda: Path("/e/bin/llama-quantize"))
        operations = ModelOperations(
            self.registry, cast(Supervisor, self.supervisor), None, self.reactor, None, creator
        )
        surface = build_gateway(
            self.registry,
            cast(Supervisor, self.supervisor),
            cast(EngineClient, None),
            self.reactor,
            operations=operations,
            wall=lambda: 0.0,
        ).ollama
        self.resource = surface.app.resource()
        self.client = StubTreq(self.resource)

    def call(self, method: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any, bytes]:
        data = raw if raw is not None else json.dumps(body).encode() if body is not None else None
        d = self.client.request(method, "http://localhost" + path, data=data)
        self.client.flush()
        response = self.successResultOf(d)
        return response.code, response.headers, self.successResultOf(response.content())

    def upload(self) -> str:
        data = self.model.read_bytes()
        status, _, _ = self.call("POST", f"/api/blobs/{sha(data)}", raw=data)
        self.assertEqual(status, 201)
        return sha(data)

    def test_blobs(self) -> None:
        data = self.model.read_bytes()
        digest = sha(data)
        status, _, body = self.call("HEAD", f"/api/blobs/{digest}")
        self.assertEqual(status, 404)
        status, _, body = self.call("POST", f"/api/blobs/{sha(b'other')}", raw=data)
        self.assertEqual(
            (status, json.loads(body)), (400, {"error": f'digest mismatch, expected "{sha(b"other")}", got "{digest}"'})
        )
        self.assertEqual(self.call("HEAD", f"/api/blobs/{sha(b'other')}")[0], 404)
        self.assertEqual(self.call("POST", f"/api/blobs/{digest}", raw=data)[0], 201)
        self.assertEqual(self.call("POST", f"/api/blobs/{digest}", raw=data)[0], 200)  # there already
        self.assertEqual(self.call("HEAD", f"/api/blobs/{digest}")[0], 200)
        status, _, body = self.call("HEAD", "/api/blobs/md5:abc")
        self.assertEqual(status, 400)
        status, _, body = self.call("POST", "/api/blobs/sha256:xyz", raw=b"x")
        self.assertEqual(status, 400)
        self.assertIn("invalid digest", json.loads(body)["error"])

    def test_create_streams_ollamas_lines(self) -> None:
        digest = self.upload()
        status, headers, body = self.call(
            "POST",
            "/api/create",
            {
                "model": "mine",
                "files": {"model.gguf": digest},
                "system": "Be brief.",
                "template": "{{ .Prompt }}",
                "parameters": {"num_predict": 3, "stop": ["<|im_end|>"], "temperature": 0.7},
            },
        )
        self.assertEqual(status, 200, body)
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"application/x-ndjson"])
        self.assertEqual(headers.getRawHeaders(b"x-blazar-ignored"), [b"template"])
        lines = [json.loads(line) for line in body.splitlines()]
        statuses = [line["status"] for line in lines]
        self.assertEqual(statuses[:2], ["parsing GGUF", f"using existing layer {digest}"])
        self.assertTrue(all(s.startswith("creating new layer sha256:") for s in statuses[2:5]), statuses)
        self.assertEqual(statuses[5:], ["writing manifest", "success"])
        # not streamed: one answer, and a second create of a name replaces it
        status, _, body = self.call(
            "POST", "/api/create", {"model": "mine", "from": "mine", "system": "Other.", "stream": False}
        )
        self.assertEqual((status, json.loads(body)), (200, {"status": "success"}))

    def test_create_refusals_are_plain_errors(self) -> None:
        cases = [
            ({"model": "mine"}, 400, "neither 'from' or 'files' was specified"),
            ({"model": "mine", "from": "nope"}, 404, 'model "nope" not found'),
            ({"model": "mine", "files": {"m.gguf": "sha256:" + "0" * 64}}, 404, "upload it first"),
            ({"model": "base", "from": "base"}, 400, "is a file in models_dir"),
            ({"model": "mine", "from": "base", "quantize": "q9"}, 400, "unknown quantization type"),
            ({"model": "x y"}, 400, "invalid model name"),
            ({"model": "mine", "modelfile": "FROM base\nBOGUS x\n"}, 400, "(line 2): command must be one of"),
        ]
        for body, status, message in cases:
            got, headers, data = self.call("POST", "/api/create", body)
            self.assertEqual(got, status, (body, data))
            self.assertIn(message, json.loads(data)["error"], body)

    def test_the_legacy_modelfile_form(self) -> None:
        digest = self.upload()
        status, _, body = self.call(
            "POST",
            "/api/create",
            {
                "name": "mine",
                "modelfile": f"FROM @{digest}\nSYSTEM Be brief.\nPARAMETER num_ctx 1024\n",
                "stream": False,
            },
        )
        self.assertEqual((status, json.loads(body)), (200, {"status": "success"}))
        status, _, body = self.call("POST", "/api/show", {"model": "mine"})
        shown = json.loads(body)
        self.assertEqual(
            (shown["system"], shown["parameters"].splitlines()[0]), ("Be brief.", "num_ctx                        1024")
        )

    def test_show_a_created_model(self) -> None:
        digest = self.upload()
        self.call(
            "POST",
            "/api/create",
            {
                "model": "mine",
                "files": {"model.gguf": digest},
                "system": "Be\nbrief.",
                "template": "{{ .Prompt }}!",
                "parameters": {"num_predict": 3, "stop": ["<|im_end|>", "</s>"], "temperature": 0.7},
                "messages": [{"role": "user", "content": "hi"}],
                "license": "MIT",
                "stream": False,
            },
        )
        status, _, body = self.call("POST", "/api/show", {"model": "mine"})
        self.assertEqual(status, 200, body)
        shown = json.loads(body)
        blob = self.root / "blobs" / f"sha256-{digest[7:]}"
        self.assertEqual(
            shown["modelfile"],
            '# Modelfile generated by "ollama show"\n'
            "# To build a new Modelfile based on this, replace FROM with:\n"
            "# FROM mine:latest\n\n"
            f"FROM {blob}\n"
            "TEMPLATE {{ .Prompt }}!\n"
            'SYSTEM "Be\nbrief."\n'
            "PARAMETER num_predict 3\n"
            "PARAMETER stop <|im_end|>\n"
            "PARAMETER stop </s>\n"
            "PARAMETER temperature 0.7\n"
            "LICENSE MIT\n"
            "MESSAGE user hi\n",
        )
        self.assertEqual(
            [c.name for c in parse(shown["modelfile"])],
            ["model", "template", "system", "num_predict", "stop", "stop", "temperature", "license", "message"],
        )
        self.assertEqual(
            shown["parameters"],
            "num_predict                    3\n"
            'stop                           "<|im_end|>"\n'
            'stop                           "</s>"\n'
            "temperature                    0.7\n"
            "num_ctx                        2048\n"
            "num_parallel                   4",
        )
        self.assertEqual(
            (shown["system"], shown["license"], shown["messages"]),
            ("Be\nbrief.", "MIT", [{"role": "user", "content": "hi"}]),
        )
        self.assertTrue(shown["template"].startswith("{%- if tools %}"))  # the GGUF's own: what llama-server uses
        self.assertEqual(shown["details"]["quantization_level"], "F32")
        self.assertEqual(shown["capabilities"], ["completion", "tools", "insert"])  # (it has FIM tokens)
        self.assertNotIn("general.name", shown["model_info"])
        self.assertEqual(shown["model_info"]["tokenizer.ggml.tokens"], [])  # (a long array, as Ollama elides it)
        _, _, body = self.call("POST", "/api/show", {"model": "mine", "verbose": True})
        self.assertEqual(json.loads(body)["model_info"], shown["model_info"])  # (its arrays are all long)
        self.assertNotIn("projector_info", shown)

    def test_show_a_plain_model(self) -> None:
        from blazar.models.testprojector import make_test_projector

        make_test_projector(self.models / "mmproj-base.gguf")
        status, _, body = self.call("POST", "/api/show", {"model": "base"})
        self.assertEqual(status, 200, body)
        shown = json.loads(body)
        self.assertEqual(
            shown["modelfile"].splitlines()[4:7],
            [f"FROM {self.model}", f"FROM {self.models / 'mmproj-base.gguf'}", "TEMPLATE {{ .Prompt }}"],
        )
        self.assertEqual(shown["parameters"], "num_ctx                        2048\nnum_parallel                   4")
        for absent in ("system", "license", "messages"):
            self.assertNotIn(absent, shown)
        self.assertIn("vision", shown["capabilities"])
        self.assertEqual(shown["projector_info"]["general.architecture"], "clip")

    def test_a_scoped_key_may_not_create_or_upload(self) -> None:
        from blazar.config import KeyConfig
        from tests.web.gateway import Capture

        capture = Capture(self.resource)
        capture.key = KeyConfig("tenant", "tenant-secret-0123456789", models=("base",))
        self.client = StubTreq(capture)
        digest = sha(b"x")
        for method, path, body in [
            ("POST", "/api/create", {"model": "mine", "from": "base"}),
            ("HEAD", f"/api/blobs/{digest}", None),
            ("POST", f"/api/blobs/{digest}", None),
        ]:
            status, _, data = self.call(method, path, body, raw=b"x" if body is None and method == "POST" else None)
            self.assertEqual(status, 403, (path, data))
        self.assertFalse((self.root / "blobs").exists())


class ShowKvTests(SynchronousTestCase):
    def test_as_ollama_shows_it(self) -> None:
        from blazar.web.ollama import show_kv

        kv = {
            "general.name": "x",
            "tokenizer.chat_template": "t",
            "a": [1, 2, 3, 4, 5],
            "b": list(range(6)),
            "c": None,
            "d": 7,
        }
        self.assertEqual(show_kv(kv), {"a": [1, 2, 3, 4, 5], "b": [], "c": [], "d": 7})
        self.assertEqual(show_kv(kv, verbose=True), {"a": [1, 2, 3, 4, 5], "b": list(range(6)), "c": [], "d": 7})
