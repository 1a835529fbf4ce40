"""
The Ollama-layout store: names parsed and shown as Ollama does, manifests
written atomically and found case-insensitively, blobs named only when
their sha256 matches, deletes that keep shared blobs.
"""

import hashlib
import json
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar.models import ollama_store as store
from blazar.models.ollama_store import (
    DigestMismatch,
    InvalidName,
    OllamaName,
    StoreError,
    blob_path,
    layer,
    make_manifest,
    parse_name,
)


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class NameTests(SynchronousTestCase):
    def test_defaults(self) -> None:
        self.assertEqual(parse_name("qwen3"), OllamaName("registry.ollama.ai", "library", "qwen3", "latest"))
        self.assertEqual(parse_name("qwen3").full, "registry.ollama.ai/library/qwen3:latest")
        self.assertEqual(parse_name("qwen3:0.6b").display, "qwen3:0.6b")

    def test_namespace_and_host(self) -> None:
        self.assertEqual(parse_name("me/tiny:v1"), OllamaName("registry.ollama.ai", "me", "tiny", "v1"))
        self.assertEqual(parse_name("me/tiny:v1").display, "me/tiny:v1")
        name = parse_name("127.0.0.1:5000/me/tiny")
        self.assertEqual(name, OllamaName("127.0.0.1:5000", "me", "tiny", "latest"))
        self.assertEqual(name.display, "127.0.0.1:5000/me/tiny:latest")
        self.assertEqual(name.repository, "me/tiny")
        self.assertFalse(name.default_host)

    def test_default_host_and_namespace_are_shown_short(self) -> None:
        self.assertEqual(parse_name("registry.ollama.ai/library/qwen3:4b").display, "qwen3:4b")
        self.assertEqual(parse_name("https://registry.ollama.ai/me/x").display, "me/x:latest")
        self.assertEqual(parse_name("hf.co/user/repo:Q4_K_M").display, "hf.co/user/repo:Q4_K_M")

    def test_case_folded_key(self) -> None:
        self.assertEqual(parse_name("Qwen3:Latest").key(), parse_name("qwen3").key())

    def test_refused(self) -> None:
        for bad in [
            "",
            ":tag",
            "a/b/c/d",
            "-x",
            "x:-t",
            "ns.dot/m",
            "a b",
            "m@sha256:00",
            "x:" + "t" * 81,
            "../x",
            "m/..",
            "a/:t",
        ]:
            with self.subTest(bad=bad):
                self.assertRaises(InvalidName, parse_name, bad)

    def test_invalid_name_is_a_value_error(self) -> None:
        self.assertTrue(issubclass(InvalidName, ValueError))


class ManifestTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = Path(self.mktemp())
        self.root.mkdir()
        self.source = self.root / "src.gguf"
        self.source.write_bytes(b"GGUF weights")

    def model(self, name: str, extra: list[dict[str, object]] | None = None) -> dict[str, Any]:
        digest = sha(self.source.read_bytes())
        store.thd_add_blob(self.root, self.source, digest)
        config = store.thd_add_bytes(self.root, b'{"model_format":"gguf"}')
        manifest = make_manifest(
            layer(store.MEDIA_CONFIG, config, len(b'{"model_format":"gguf"}')),
            [layer(store.MEDIA_MODEL, digest, self.source.stat().st_size), *(extra or [])],
        )
        store.thd_write_manifest(self.root, parse_name(name), manifest)
        return manifest

    def test_layout_is_ollamas(self) -> None:
        manifest = self.model("tiny")
        path = self.root / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
        self.assertEqual(json.loads(path.read_bytes()), manifest)
        digest = manifest["layers"][0]["digest"]
        self.assertTrue((self.root / "blobs" / f"sha256-{digest[7:]}").is_file())
        self.assertEqual(path.read_bytes(), store.manifest_bytes(manifest))

    def test_list_and_read(self) -> None:
        a = self.model("tiny")
        b = self.model("me/other:v2")
        listed = store.thd_list(self.root)
        self.assertEqual(
            sorted((n.display, m == (a if n.model == "tiny" else b)) for n, m in listed),
            [("me/other:v2", True), ("tiny:latest", True)],
        )
        self.assertEqual(store.thd_read_manifest(self.root, parse_name("TINY:latest")), a)

    def test_list_skips_junk(self) -> None:
        self.model("tiny")
        junk = self.root / "manifests" / "registry.ollama.ai" / "library" / "junk" / "latest"
        junk.parent.mkdir(parents=True)
        junk.write_text("not json")
        (junk.parent / ".tmp-latest-1234").write_text("{}")
        self.assertEqual([n.display for n, _ in store.thd_list(self.root)], ["tiny:latest"])

    def test_digest_is_the_manifest_files(self) -> None:
        manifest = self.model("tiny")
        self.assertEqual(store.thd_manifest_digest(self.root, parse_name("tiny")), sha(store.manifest_bytes(manifest)))

    def test_write_refuses_missing_blobs(self) -> None:
        manifest = make_manifest(layer(store.MEDIA_CONFIG, sha(b"x"), 1), [layer(store.MEDIA_MODEL, sha(b"y"), 1)])
        with self.assertRaises(StoreError) as caught:
            store.thd_write_manifest(self.root, parse_name("tiny"), manifest)
        self.assertIn("not in the store", str(caught.exception))
        self.assertEqual(store.thd_list(self.root), [])

    def test_write_refuses_a_bad_manifest(self) -> None:
        for bad in [{}, {"schemaVersion": 2}, {"schemaVersion": 2, "layers": [{"digest": "md5:x", "size": 1}]}]:
            with self.subTest(bad=bad):
                self.assertRaises(StoreError, store.thd_write_manifest, self.root, parse_name("x"), bad)

    def test_rewrite_keeps_the_existing_spelling(self) -> None:
        self.model("Tiny")
        self.model("tiny")
        names = [n.display for n, _ in store.thd_list(self.root)]
        self.assertEqual(names, ["Tiny:latest"])

    def test_missing_manifest(self) -> None:
        self.assertRaises(FileNotFoundError, store.thd_read_manifest, self.root, parse_name("nope"))
        self.assertRaises(FileNotFoundError, store.thd_delete_manifest, self.root, parse_name("nope"))

    def test_delete_keeps_shared_and_unreferenced_blobs(self) -> None:
        self.model("tiny")
        self.model("copy")
        pending = store.thd_add_bytes(self.root, b"an upload waiting for its create")
        self.assertEqual(store.thd_delete_manifest(self.root, parse_name("tiny")), [])
        self.assertEqual([n.display for n, _ in store.thd_list(self.root)], ["copy:latest"])
        removed = store.thd_delete_manifest(self.root, parse_name("copy"))
        self.assertEqual(len(removed), 2)  # the weights and the config
        self.assertTrue(store.thd_has_blob(self.root, pending))
        self.assertFalse((self.root / "manifests" / "registry.ollama.ai").exists())

    def test_delete_leaves_the_blobs_a_pull_or_create_holds(self) -> None:
        manifest = self.model("tiny")
        weights = manifest["layers"][0]["digest"]
        config = manifest["config"]["digest"]
        # a pull of another model naming the same weights: there already, so skipped, then its manifest
        with store.hold(self.root, [weights]):
            self.assertEqual(store.held_digests(self.root), {weights})
            self.assertEqual(store.thd_delete_manifest(self.root, parse_name("tiny")), [config])
            self.assertTrue(store.thd_has_blob(self.root, weights))
            other = make_manifest(
                layer(store.MEDIA_CONFIG, store.thd_add_bytes(self.root, b"{}"), 2), [manifest["layers"][0]]
            )
            store.thd_write_manifest(self.root, parse_name("other"), other)
        self.assertEqual(store.held_digests(self.root), set())
        self.assertEqual(
            sorted(store.thd_delete_manifest(self.root, parse_name("other"))), sorted([weights, sha(b"{}")])
        )
        self.assertEqual(list((self.root / "blobs").iterdir()), [])  # (no renamed blob left behind)

    def test_holds_count(self) -> None:
        digest = sha(b"x")
        with store.hold(self.root, [digest]) as first:
            with store.hold(self.root) as second:
                second.add([digest])
            self.assertEqual(store.held_digests(self.root), {digest})
            first.release()
            self.assertEqual(store.held_digests(self.root), set())
        self.assertEqual(store.held_digests(self.root), set())

    def test_manifest_writes_wait_for_the_stores_lock(self) -> None:
        import fcntl
        import os
        import threading

        manifest = self.model("tiny")
        done = threading.Event()

        def write() -> None:
            store.thd_write_manifest(self.root, parse_name("copy"), manifest)
            done.set()

        with store.thd_store_lock(self.root):
            # another daemon on this store finds it locked
            fd = os.open(self.root / store.LOCK_FILE, os.O_RDWR)
            try:
                self.assertRaises(BlockingIOError, fcntl.flock, fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
            writer = threading.Thread(target=write)
            writer.start()
            self.assertFalse(done.wait(0.2))
        writer.join(10)
        self.assertTrue(done.is_set())
        self.assertEqual(sorted(n.display for n, _ in store.thd_list(self.root)), ["copy:latest", "tiny:latest"])


class SweepTests(SynchronousTestCase):
    def test_temporaries_older_than_the_start_are_removed(self) -> None:
        import os

        root = Path(self.mktemp())
        blobs = root / "blobs"
        tag = root / "manifests" / "registry.ollama.ai" / "library" / "tiny"
        tag.mkdir(parents=True)
        blobs.mkdir()
        hexd = "a" * 64
        stale = [
            blobs / ".tmp-upload-x1y2",
            blobs / f".tmp-sha256-{hexd}-0a0b",
            blobs / ".tmp-quantize-1f.gguf",
            blobs / "..tmp-quantize-1f.gguf.0c0d.quantizing",
            blobs / f".sha256-{hexd}-partial-2.tmp",
            tag / ".tmp-latest-0e0f",
        ]
        kept = [
            blobs / f"sha256-{hexd}",
            blobs / f"sha256-{hexd}-partial",
            blobs / f"sha256-{hexd}-partial-0",
            tag / "latest",
            root / store.LOCK_FILE,
        ]
        for path in stale + kept:
            path.write_bytes(b"x")
            os.utime(path, (1000.0, 1000.0))
        fresh = blobs / ".tmp-upload-now"  # written since the start: this daemon's
        fresh.write_bytes(b"x")
        os.utime(fresh, (3000.0, 3000.0))
        self.assertEqual(sorted(store.thd_sweep_temporaries(root, 2000.0)), sorted(stale))
        self.assertEqual(sorted(p for p in root.rglob("*") if p.is_file()), sorted([*kept, fresh]))
        self.assertEqual(store.thd_sweep_temporaries(Path(self.mktemp()), 2000.0), [])  # no store yet


class BlobTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = Path(self.mktemp())
        self.root.mkdir()
        self.source = self.root / "src.bin"
        self.source.write_bytes(b"x" * 3000)
        self.digest = sha(b"x" * 3000)

    def test_blob_path(self) -> None:
        self.assertEqual(blob_path(self.root, self.digest), self.root / "blobs" / ("sha256-" + self.digest[7:]))
        self.assertEqual(blob_path(self.root, "sha256-" + self.digest[7:]), blob_path(self.root, self.digest))
        for bad in ["sha256:ABC", "md5:" + "0" * 32, "sha256:../../etc", ""]:
            self.assertRaises(StoreError, blob_path, self.root, bad)

    def test_add_verifies(self) -> None:
        path = store.thd_add_blob(self.root, self.source, self.digest)
        self.assertEqual(path.read_bytes(), b"x" * 3000)
        self.assertTrue(store.thd_has_blob(self.root, self.digest, 3000))
        self.assertFalse(store.thd_has_blob(self.root, self.digest, 2999))

    def test_add_refuses_a_mismatch_and_leaves_nothing(self) -> None:
        wrong = sha(b"other")
        with self.assertRaises(DigestMismatch) as caught:
            store.thd_add_blob(self.root, self.source, wrong)
        self.assertIn(wrong, str(caught.exception))
        self.assertEqual(caught.exception.actual, self.digest)
        self.assertEqual(list((self.root / "blobs").iterdir()), [])

    def test_link_is_zero_copy(self) -> None:
        path = store.thd_link_blob(self.root, self.source, self.digest)
        self.assertEqual(path.stat().st_ino, self.source.stat().st_ino)
        self.assertRaises(DigestMismatch, store.thd_link_blob, self.root, self.source, sha(b"no"))

    def test_a_symlinked_source_is_linked_as_its_file(self) -> None:
        """
        A model linked into models_dir (as the README adds SmolLM2) becomes
        a blob that is the file itself, not a second symlink to it.
        """
        link = self.root / "linked.bin"
        link.symlink_to(self.source.absolute())
        path = store.thd_link_blob(self.root, link, self.digest)
        self.assertFalse(path.is_symlink())
        self.assertEqual(path.stat().st_ino, self.source.stat().st_ino)

    def test_add_bytes(self) -> None:
        digest = store.thd_add_bytes(self.root, b"hello")
        self.assertEqual(blob_path(self.root, digest).read_bytes(), b"hello")
        self.assertEqual(store.thd_add_bytes(self.root, b"hello"), digest)


class LayersTests(SynchronousTestCase):
    def test_layers_read(self) -> None:
        root = Path(self.mktemp())
        root.mkdir()
        weights = store.thd_add_bytes(root, b"GGUF....")
        projector = store.thd_add_bytes(root, b"GGUF proj")
        adapter = store.thd_add_bytes(root, b"GGUF lora")
        texts = {
            store.MEDIA_TEMPLATE: b"{{ .Prompt }}",
            store.MEDIA_SYSTEM: b"Be brief.",
            store.MEDIA_PARAMS: b'{"num_ctx": 4096, "stop": ["<|im_end|>"]}',
            store.MEDIA_MESSAGES: b'[{"role": "user", "content": "hi"}]',
            store.MEDIA_LICENSE: b"MIT",
        }
        layers = [
            layer(store.MEDIA_MODEL, weights, 8),
            layer(store.MEDIA_PROJECTOR, projector, 9),
            layer(store.MEDIA_ADAPTER, adapter, 9),
        ]
        layers += [layer(media, store.thd_add_bytes(root, data), len(data)) for media, data in texts.items()]
        config = store.thd_add_bytes(root, b'{"model_family": "llama"}')
        manifest = make_manifest(layer(store.MEDIA_CONFIG, config, 25), layers)
        digest = store.thd_write_manifest(root, parse_name("me/vis:1"), manifest)
        (found,) = store.thd_models(root)
        self.assertEqual(found.name.display, "me/vis:1")
        self.assertEqual(found.digest, digest)
        self.assertEqual(found.model, blob_path(root, weights))
        self.assertEqual(found.projector, blob_path(root, projector))
        self.assertEqual(found.adapters, (blob_path(root, adapter),))
        self.assertEqual((found.template, found.system, found.license), ("{{ .Prompt }}", "Be brief.", "MIT"))
        self.assertEqual(found.parameters, {"num_ctx": 4096, "stop": ["<|im_end|>"]})
        self.assertEqual(found.messages, [{"role": "user", "content": "hi"}])
        self.assertEqual(found.config, {"model_family": "llama"})
        self.assertEqual(found.size, 25 + 8 + 9 + 9 + sum(len(d) for d in texts.values()))
        hash(found)  # an entry carrying it stays hashable

    def test_a_model_whose_weights_are_gone_is_not_listed(self) -> None:
        root = Path(self.mktemp())
        root.mkdir()
        weights = store.thd_add_bytes(root, b"GGUF")
        store.thd_write_manifest(root, parse_name("x"), make_manifest({}, [layer(store.MEDIA_MODEL, weights, 4)]))
        blob_path(root, weights).unlink()
        self.assertEqual(store.thd_models(root), [])


class RegistryStoreTests(SynchronousTestCase):
    """
    The registry serves the store's models: named as Ollama shows them, the
    model layer's blob as the file, the manifest's digest; copy writes a
    manifest, delete removes one; a models_dir file of the same name wins.
    """

    def setUp(self) -> None:
        from blazar.config import parse_config
        from blazar.models.registry import ModelRegistry
        from blazar.models.testmodel import make_test_model
        from blazar.testing import fake_process_reactor

        base = Path(self.mktemp()).absolute()
        self.models = base / "models"
        self.models.mkdir(parents=True)
        self.root = base / "store"
        self.gguf = make_test_model(base / "tiny.gguf").path
        self.manifest = store.thd_put_model(
            self.root, parse_name("me/tiny:v1"), self.gguf, {store.MEDIA_SYSTEM: b"Be brief."}
        )
        self.registry = ModelRegistry(
            parse_config(f'models_dir = "{self.models}"\nollama_models = "{self.root}"\n'), fake_process_reactor()
        )

    def resolve(self, name: str):
        from twisted.internet.defer import ensureDeferred

        return self.successResultOf(ensureDeferred(self.registry.resolve(name)))

    def test_listed_and_resolved(self) -> None:
        from twisted.internet.defer import ensureDeferred

        entry = self.resolve("ME/tiny:v1")
        self.assertEqual(entry.name, "me/tiny:v1")
        self.assertEqual(entry.path, blob_path(self.root, self.manifest["layers"][0]["digest"]))
        assert entry.ollama is not None
        self.assertEqual(entry.ollama.system, "Be brief.")
        digest = self.successResultOf(ensureDeferred(self.registry.digest(entry)))
        self.assertEqual(digest, sha(store.manifest_bytes(self.manifest)))
        meta = self.successResultOf(ensureDeferred(self.registry.metadata(entry)))
        self.assertEqual(meta.architecture, "llama")

    def test_copy_is_a_manifest_and_delete_keeps_shared_blobs(self) -> None:
        from twisted.internet.defer import ensureDeferred

        entry = self.resolve("me/tiny:v1")
        copied = self.successResultOf(ensureDeferred(self.registry.copy(entry, "tiny2")))
        self.assertEqual(copied, "tiny2:latest")
        copy = self.resolve("tiny2")
        self.assertEqual(copy.path, entry.path)
        self.assertEqual(
            (self.root / "manifests" / "registry.ollama.ai" / "library" / "tiny2" / "latest").read_bytes(),
            store.manifest_bytes(self.manifest),
        )
        self.successResultOf(ensureDeferred(self.registry.remove(entry)))
        self.assertTrue(copy.path.exists())
        self.successResultOf(ensureDeferred(self.registry.remove(copy)))
        self.assertFalse(copy.path.exists())
        self.assertTrue(self.gguf.exists())  # the linked source is untouched
        self.assertEqual(self.successResultOf(ensureDeferred(self.registry.refresh())), [])

    def test_copy_to_a_taken_name_is_refused(self) -> None:
        from twisted.internet.defer import ensureDeferred

        from blazar.models.registry import ModelChangeError

        entry = self.resolve("me/tiny:v1")
        self.failureResultOf(ensureDeferred(self.registry.copy(entry, "ME/tiny:v1")), ModelChangeError)
        self.failureResultOf(ensureDeferred(self.registry.copy(entry, "a/b/c/d")), ModelChangeError)

    def test_a_models_dir_file_of_the_same_name_wins(self) -> None:
        from twisted.internet.defer import ensureDeferred

        store.thd_put_model(self.root, parse_name("tiny"), self.gguf)
        (self.models / "tiny.gguf").write_bytes(self.gguf.read_bytes())
        self.successResultOf(ensureDeferred(self.registry.refresh()))
        self.successResultOf(ensureDeferred(self.registry.refresh()))
        self.assertEqual(self.resolve("tiny").path, self.models / "tiny.gguf")
        warnings = self.flushLoggedErrors()
        self.assertEqual(warnings, [])
        self.assertEqual(self.registry._hidden, {"tiny:latest"})
