"""
Creating models of the Ollama store (L{blazar.models.create}) on a real
store in a temporary directory, with a fake reactor (thread work inline,
llama-quantize a fake child): the layers and status lines Ollama's create
gives, zero-copy sources, uploads named only once their sha256 matches.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import parse_config
from blazar.models.create import (
    QUANTIZE_DIGEST,
    CreateError,
    CreateSpec,
    ModelCreator,
    thd_gguf_kind,
    thd_store_upload,
    upload_spool,
    valid_file_name,
)
from blazar.models.ollama_store import (
    MEDIA_ADAPTER,
    MEDIA_CONFIG,
    MEDIA_LICENSE,
    MEDIA_MESSAGES,
    MEDIA_MODEL,
    MEDIA_PARAMS,
    MEDIA_PROJECTOR,
    MEDIA_SYSTEM,
    MEDIA_TEMPLATE,
    DigestMismatch,
    blob_path,
    held_digests,
    parse_name,
    thd_delete_manifest,
    thd_read_manifest,
)
from blazar.models.registry import ModelRegistry
from blazar.models.testmodel import make_test_lora, make_test_model
from blazar.testing import fake_process_reactor


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class UploadTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = Path(self.mktemp()).absolute()

    def test_a_body_in_memory_is_copied_in(self) -> None:
        data = b"GGUF blob"
        self.assertTrue(thd_store_upload(self.root, io.BytesIO(data), sha(data)))
        self.assertEqual(blob_path(self.root, sha(data)).read_bytes(), data)
        self.assertFalse(thd_store_upload(self.root, io.BytesIO(b"whatever"), sha(data)))  # there already
        self.assertEqual(sorted(p.name for p in (self.root / "blobs").iterdir()), [f"sha256-{sha(data)[7:]}"])

    def test_a_wrong_digest_names_nothing(self) -> None:
        error = self.assertRaises(DigestMismatch, thd_store_upload, self.root, io.BytesIO(b"abc"), sha(b"abd"))
        self.assertEqual((error.expected, error.actual), (sha(b"abd"), sha(b"abc")))
        self.assertEqual(list((self.root / "blobs").iterdir()), [])

    def test_a_body_spooled_into_the_store_is_linked(self) -> None:
        spool = upload_spool(self.root)
        assert spool is not None
        spool.write(b"x" * 3000)
        self.assertTrue(thd_store_upload(self.root, spool, sha(b"x" * 3000)))
        blob = blob_path(self.root, sha(b"x" * 3000))
        self.assertEqual(Path(spool.name).stat().st_ino, blob.stat().st_ino)  # a link, not a copy
        spool.close()  # (as twisted.web closes a request's content)
        self.assertEqual(blob.read_bytes(), b"x" * 3000)
        self.assertEqual([p.name for p in (self.root / "blobs").iterdir()], [blob.name])
        bad = upload_spool(self.root)
        assert bad is not None
        bad.write(b"y")
        self.assertRaises(DigestMismatch, thd_store_upload, self.root, bad, sha(b"z"))
        bad.close()
        self.assertEqual([p.name for p in (self.root / "blobs").iterdir()], [blob.name])

    def test_valid_file_names(self) -> None:
        for name in ("model.gguf", "a/b.gguf", "."):
            self.assertTrue(valid_file_name(name), name)
        for name in ("", "/m.gguf", "../m", "a/../b", "a//b", "a/./b", "a/"):
            self.assertFalse(valid_file_name(name), name)


class CreateTests(SynchronousTestCase):
    def setUp(self) -> None:
        base = Path(self.mktemp()).absolute()
        self.models, self.root = base / "models", base / "store"
        self.source = make_test_model(self.models / "base.gguf").path
        self.reactor = fake_process_reactor()
        self.registry = ModelRegistry(
            parse_config(f'models_dir = "{self.models}"\nollama_models = "{self.root}"'), self.reactor
        )
        self.creator = ModelCreator(self.registry, self.reactor, lambda: Path("/e/bin/llama-quantize"))
        self.lines: list[dict[str, Any]] = []

    def upload(self, path: Path) -> str:
        data = path.read_bytes()
        self.assertTrue(self.successResultOf(ensureDeferred(self.creator.store_upload(sha(data), io.BytesIO(data)))))
        self.assertTrue(self.successResultOf(ensureDeferred(self.creator.has_blob(sha(data)))))
        return sha(data)

    def start(self, **fields: Any) -> Deferred[str]:
        spec = CreateSpec(name=parse_name(fields.pop("name", "mine")), **fields)
        return ensureDeferred(self.creator.create(spec, self.lines.append))

    def create(self, **fields: Any) -> str:
        return self.successResultOf(self.start(**fields))

    def refused(self, **fields: Any) -> CreateError:
        return self.failureResultOf(self.start(**fields), CreateError).value

    def manifest(self, name: str = "mine") -> dict[str, Any]:
        return thd_read_manifest(self.root, parse_name(name))

    def statuses(self) -> list[str]:
        return [line["status"] for line in self.lines]

    def test_from_uploaded_files_with_every_text_layer(self) -> None:
        digest = self.upload(self.source)
        name = self.create(
            files={"model.gguf": digest},
            template="{{ .Prompt }}",
            system="Be brief.",
            parameters={"stop": ["<|im_end|>"], "num_predict": 3, "temperature": 0.5},
            messages=({"role": "user", "content": "hi"},),
            license=("MIT",),
        )
        self.assertEqual(name, "mine:latest")
        manifest = self.manifest()
        layers = manifest["layers"]
        self.assertEqual(
            [d["mediaType"] for d in layers],
            [MEDIA_MODEL, MEDIA_TEMPLATE, MEDIA_SYSTEM, MEDIA_LICENSE, MEDIA_PARAMS, MEDIA_MESSAGES],
        )
        self.assertEqual(layers[0]["digest"], digest)
        self.assertEqual(
            blob_path(self.root, layers[4]["digest"]).read_bytes(),
            b'{"num_predict":3,"stop":["\\u003c|im_end|\\u003e"],"temperature":0.5}\n',
        )
        self.assertEqual(blob_path(self.root, layers[5]["digest"]).read_bytes(), b'[{"role":"user","content":"hi"}]\n')
        self.assertEqual(
            self.statuses(),
            [
                "parsing GGUF",
                f"using existing layer {digest}",
                *[f"creating new layer {d['digest']}" for d in layers[1:]],
                "writing manifest",
            ],
        )
        self.assertEqual(manifest["config"]["mediaType"], MEDIA_CONFIG)
        config = json.loads(blob_path(self.root, manifest["config"]["digest"]).read_bytes())
        self.assertEqual(
            {
                k: config[k]
                for k in ("model_format", "model_family", "model_families", "file_type", "architecture", "os")
            },
            {
                "model_format": "gguf",
                "model_family": "llama",
                "model_families": ["llama"],
                "file_type": "F32",
                "architecture": "amd64",
                "os": "linux",
            },
        )
        self.assertEqual(config["rootfs"]["diff_ids"], [d["digest"] for d in layers])
        entry = self.successResultOf(ensureDeferred(self.registry.resolve("mine")))
        assert entry.ollama is not None
        self.assertEqual(
            (entry.ollama.system, entry.ollama.template, entry.ollama.license), ("Be brief.", "{{ .Prompt }}", "MIT")
        )
        self.assertEqual(entry.ollama.parameters, {"num_predict": 3, "stop": ["<|im_end|>"], "temperature": 0.5})
        # a second create of the same blob and text: every layer is there already
        self.lines.clear()
        self.create(name="again", files={"model.gguf": digest}, system="Be brief.")
        self.assertEqual(
            self.statuses()[1:3], [f"using existing layer {digest}", f"using existing layer {layers[2]['digest']}"]
        )

    def test_from_a_models_dir_file_is_a_hard_link(self) -> None:
        from blazar.models.testprojector import make_test_projector

        projector = make_test_projector(self.models / "mmproj-base.gguf")
        self.create(source="base", system="Hi.")
        model, paired = self.manifest()["layers"][:2]
        self.assertEqual((model["mediaType"], paired["mediaType"]), (MEDIA_MODEL, MEDIA_PROJECTOR))
        self.assertEqual(blob_path(self.root, model["digest"]).stat().st_ino, self.source.stat().st_ino)
        self.assertEqual(blob_path(self.root, paired["digest"]).stat().st_ino, projector.stat().st_ino)
        self.assertEqual(self.statuses()[0], f"using existing layer {model['digest']}")
        self.assertNotIn("parsing GGUF", self.statuses())

    def test_from_a_store_model_keeps_and_merges_its_layers(self) -> None:
        digest = self.upload(self.source)
        self.create(
            name="first",
            files={"model.gguf": digest},
            system="One.",
            template="{{ .Prompt }}",
            parameters={"temperature": 0.5, "stop": ["a"]},
            messages=({"role": "user", "content": "x"},),
            license=("MIT",),
        )
        self.lines.clear()
        self.create(name="second", source="first", parameters={"stop": ["b"], "num_predict": 3}, license=("BSD",))
        second = self.successResultOf(ensureDeferred(self.registry.resolve("second")))
        assert second.ollama is not None
        self.assertEqual((second.ollama.system, second.ollama.template), ("One.", "{{ .Prompt }}"))
        self.assertEqual(second.ollama.parameters, {"temperature": 0.5, "stop": ["b"], "num_predict": 3})
        self.assertEqual(second.ollama.messages, [{"role": "user", "content": "x"}])
        self.assertEqual(second.ollama.license, "MIT\n\nBSD")
        self.assertTrue(all(s.startswith("using existing layer") for s in self.statuses()[:4]), self.statuses())
        self.create(name="third", source="second", system="Three.", messages=({"role": "user", "content": "y"},))
        third = self.successResultOf(ensureDeferred(self.registry.resolve("third")))
        assert third.ollama is not None
        self.assertEqual((third.ollama.system, third.ollama.messages), ("Three.", [{"role": "user", "content": "y"}]))
        media = [d["mediaType"] for d in self.manifest("third")["layers"]]
        self.assertEqual((media.count(MEDIA_SYSTEM), media.count(MEDIA_MESSAGES)), (1, 1))

    def test_adapters_and_projectors_by_their_headers(self) -> None:
        from blazar.models.testprojector import make_test_projector

        model = self.upload(self.source)
        lora = self.upload(make_test_lora(self.models / "l" / "style.gguf"))
        projector = self.upload(make_test_projector(self.models / "p" / "mmproj.gguf"))
        self.create(files={"model.gguf": model, "mmproj.gguf": projector}, adapters={"style.gguf": lora})
        self.assertEqual(
            [(d["mediaType"], d["digest"]) for d in self.manifest()["layers"]],
            [(MEDIA_PROJECTOR, projector), (MEDIA_MODEL, model), (MEDIA_ADAPTER, lora)],
        )  # by name
        self.assertEqual(self.statuses().count("parsing GGUF"), 3)
        self.assertIn(
            "is not a LoRA adapter GGUF", str(self.refused(files={"m.gguf": model}, adapters={"a.gguf": model}))
        )
        self.assertIn("no model layer", str(self.refused(files={"a.gguf": lora})))
        self.assertEqual(thd_gguf_kind(blob_path(self.root, lora)), MEDIA_ADAPTER)

    def test_refusals(self) -> None:
        digest = self.upload(self.source)
        other = self.upload(make_test_model(self.models / "o" / "other.gguf", seed=3).path)
        text = self.upload_bytes(b"not a model")
        cases: list[tuple[dict[str, Any], int, str]] = [
            ({}, 400, "neither 'from' or 'files' was specified"),
            ({"source": "nope"}, 404, 'model "nope" not found'),
            ({"name": "base", "source": "base"}, 400, 'model "base:latest" is a file in models_dir'),
            ({"files": {"m.gguf": "sha256:" + "0" * 64}}, 404, "upload it first (POST /api/blobs/sha256:000"),
            ({"files": {"m.gguf": text}}, 400, "supplied file was not in GGUF format"),
            ({"files": {"m.safetensors": digest}}, 400, "GGUF files only"),
            ({"files": {"a.gguf": digest, "b.gguf": other}}, 400, "more than one model GGUF"),
        ]
        for fields, status, message in cases:
            error = self.refused(**fields)
            self.assertEqual(error.status, status, fields)
            self.assertIn(message, str(error), fields)
        self.assertFalse((self.root / "manifests").exists())  # nothing named

    def upload_bytes(self, data: bytes) -> str:
        self.successResultOf(ensureDeferred(self.creator.store_upload(sha(data), io.BytesIO(data))))
        return sha(data)

    def test_quantize(self) -> None:
        digest = self.upload(self.source)
        d = self.start(files={"model.gguf": digest}, quantize="Q8_0", asked_quantize="Q8_0")
        ((transport, executable, argv, _),) = self.reactor.spawned
        self.assertEqual(
            (executable, argv[1], argv[3]), ("/e/bin/llama-quantize", str(blob_path(self.root, digest)), "Q8_0")
        )
        output = make_test_model(self.models / "q" / "out.gguf", seed=9).path.read_bytes()
        Path(argv[2]).write_bytes(output)
        transport.protocol.childDataReceived(2, b"[   1/  2] a.weight - done\n[   2/  2] b.weight - done\n")
        self.assertNoResult(d)
        transport.exit(0)
        self.successResultOf(d)
        size = blob_path(self.root, digest).stat().st_size
        quantizing = [line for line in self.lines if line["status"].startswith("quantizing")]
        self.assertEqual(
            quantizing,
            [
                {"status": "quantizing F32 model to Q8_0", "digest": QUANTIZE_DIGEST, "total": size, "completed": c}
                for c in (0, size // 2, size)
            ],
        )
        model = self.manifest()["layers"][0]
        self.assertEqual(model["digest"], sha(output))
        self.assertEqual(
            self.statuses()[-3:], ["verifying conversion", f"creating new layer {sha(output)}", "writing manifest"]
        )
        leftovers = sorted(p.name for p in (self.root / "blobs").iterdir() if p.name.startswith("."))
        self.assertEqual(leftovers, [])

    def test_a_delete_during_a_create_leaves_the_blobs_it_uses(self) -> None:
        digest = self.upload(self.source)
        self.create(name="first", files={"model.gguf": digest}, system="One.")
        d = self.start(name="second", source="first", quantize="Q8_0", asked_quantize="Q8_0")
        ((transport, _, argv, _),) = self.reactor.spawned
        # while it quantizes, its source goes: the system prompt it keeps was only the source's
        config = self.manifest("first")["config"]["digest"]  # (the one blob of its that the create does not use)
        self.assertEqual(thd_delete_manifest(self.root, parse_name("first")), [config])
        output = make_test_model(self.models / "q" / "out.gguf", seed=9).path.read_bytes()
        Path(argv[2]).write_bytes(output)
        transport.exit(0)
        self.successResultOf(d)
        second = self.successResultOf(ensureDeferred(self.registry.resolve("second")))
        assert second.ollama is not None
        self.assertEqual(second.ollama.system, "One.")
        self.assertEqual(held_digests(self.root), set())

    def test_quantize_refused_and_failed(self) -> None:
        digest = self.upload(self.source)
        self.create(name="same", files={"model.gguf": digest}, quantize="F32", asked_quantize="F32")
        self.assertEqual(self.reactor.spawned, [])  # already that type
        q8 = self.upload_bytes(self.quantized())
        error = self.refused(files={"model.gguf": q8}, quantize="Q4_K_M")
        self.assertEqual(str(error), "quantization is only supported for F16, BF16 and F32 models")
        d = self.start(files={"model.gguf": digest}, quantize="Q8_0")
        ((transport, _, argv, _),) = self.reactor.spawned
        transport.protocol.childDataReceived(2, b"llama_model_quantize: failed to quantize: disk full\n")
        transport.exit(1)
        error = self.failureResultOf(d, CreateError).value
        self.assertIn("disk full", str(error))
        self.assertEqual(error.status, 500)
        self.assertFalse((self.root / "manifests" / "registry.ollama.ai" / "library" / "mine").exists())

    def test_no_quantizer(self) -> None:
        from blazar.models.quantize import QuantizeError

        def missing() -> Path:
            raise QuantizeError("the engine in use has no llama-quantize beside it")

        self.creator = ModelCreator(self.registry, self.reactor, missing)
        error = self.refused(files={"model.gguf": self.upload(self.source)}, quantize="Q8_0")
        self.assertEqual((error.status, str(error)), (500, "the engine in use has no llama-quantize beside it"))

    def quantized(self) -> bytes:
        """
        A test model whose header says Q8_0 (its weights are not: only the
        header is read).
        """
        from gguf import GGUFReader

        path = make_test_model(self.models / "q8" / "m.gguf", seed=5).path
        reader = GGUFReader(str(path), "r+")
        field = reader.fields["general.file_type"]
        field.parts[field.data[0]][0] = 7
        del reader
        return path.read_bytes()

    def test_load_time_parameters_are_the_models_settings(self) -> None:
        digest = self.upload(self.source)
        self.create(
            files={"model.gguf": digest},
            parameters={"num_ctx": 1024, "num_gpu": 0, "num_thread": 2, "use_mmap": False, "main_gpu": 1},
        )
        entry = self.successResultOf(ensureDeferred(self.registry.resolve("mine")))
        settings = entry.settings
        self.assertEqual(
            (settings.ctx_size, settings.gpu_layers, settings.threads, settings.use_mmap, settings.main_gpu),
            (1024, 0, 2, False, 1),
        )
        # the operator's [models."mine"] wins where it says something
        registry = ModelRegistry(
            parse_config(
                f'models_dir = "{self.models}"\nollama_models = "{self.root}"\n[models."mine"]\nthreads = 8\n'
            ),
            self.reactor,
        )
        settings = self.successResultOf(ensureDeferred(registry.resolve("mine"))).settings
        self.assertEqual((settings.ctx_size, settings.threads), (1024, 8))
