import errno
import os
from pathlib import Path
from typing import Any, Coroutine

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import parse_config
from blazar.models.gguf_meta import GGUFError, GGUFMetadata, unreadable
from blazar.models.registry import ModelNotFound, ModelRegistry, ModelUnreadable, thd_scan
from blazar.models.testmodel import make_test_model
from blazar.testing import fake_process_reactor


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


class ScanTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.dir.mkdir()

    def test_stem_latest_and_split_shards(self) -> None:
        touch(self.dir / "Qwen2.5-0.5B.gguf")
        touch(self.dir / "sub" / "big-00001-of-00003.gguf")
        touch(self.dir / "sub" / "big-00002-of-00003.gguf")
        touch(self.dir / "sub" / "big-00003-of-00003.gguf")
        touch(self.dir / "notes.txt")
        found = thd_scan(self.dir, {})
        self.assertEqual(sorted(e.name for e in found.values()), ["Qwen2.5-0.5B:latest", "big:latest"])
        big = found["big:latest"]
        self.assertEqual(big.path.name, "big-00001-of-00003.gguf")
        self.assertEqual([s.name for s in big.shards], ["big-00002-of-00003.gguf", "big-00003-of-00003.gguf"])

    def test_configured_names(self) -> None:
        touch(self.dir / "a.gguf")
        config = parse_config(
            f'models_dir = "{self.dir}"\n[models."chat:7b"]\npath = "a.gguf"\n[models.a]\nctx_size = 512\n'
        )
        found = thd_scan(self.dir, config.models)
        self.assertEqual(found["chat:7b"].path, self.dir / "a.gguf")
        self.assertEqual(found["a:latest"].settings.ctx_size, 512)

    def test_odd_stems_become_valid_names(self) -> None:
        touch(self.dir / "My Model (v2).gguf")
        (entry,) = thd_scan(self.dir, {}).values()
        self.assertEqual(entry.name, "My-Model-v2:latest")


class RegistryTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.reactor = fake_process_reactor()
        self.registry = ModelRegistry(parse_config(f'models_dir = "{self.dir}"'), self.reactor)

    def test_resolve_rescans_for_new_files(self) -> None:
        f = self.failureResultOf(ensureDeferred(self.registry.resolve("m")), ModelNotFound)
        self.assertIn("none", str(f.value))
        make_test_model(self.dir / "m.gguf")
        entry = self.successResultOf(ensureDeferred(self.registry.resolve("M:latest")))
        self.assertEqual(entry.name, "m:latest")
        f = self.failureResultOf(ensureDeferred(self.registry.resolve("other")))
        self.assertEqual(f.value.available, ["m:latest"])
        self.assertIn("m:latest", str(f.value))

    def test_metadata_cached_by_path_mtime_size(self) -> None:
        make_test_model(self.dir / "m.gguf")
        reads = []
        original = self.registry._read

        def counting(path, shards):
            reads.append(path)
            return original(path, shards)

        self.registry._read = counting
        entry = self.successResultOf(ensureDeferred(self.registry.resolve("m")))
        meta = self.successResultOf(ensureDeferred(self.registry.metadata(entry)))
        self.assertEqual((meta.architecture, meta.context_length, meta.block_count), ("llama", 2048, 2))
        self.assertTrue(meta.has_chat_template)
        self.successResultOf(ensureDeferred(self.registry.metadata(entry)))
        self.assertEqual(len(reads), 1)
        make_test_model(self.dir / "m.gguf", n_layer=3)
        meta = self.successResultOf(ensureDeferred(self.registry.metadata(entry)))
        self.assertEqual(meta.block_count, 3)
        self.assertEqual(len(reads), 2)


class UnreadableModelTests(SynchronousTestCase):
    """
    A model whose file cannot be read is a L{ModelUnreadable} (a
    L{GGUFError}): its message, which clients get, names the model and what
    to check, not the file's path; C{log_detail} has the path.
    """

    def setUp(self) -> None:
        self.dir = Path(self.mktemp()).absolute()
        self.path = make_test_model(self.dir / "x.gguf").path
        self.registry = ModelRegistry(parse_config(f'models_dir = "{self.dir}"'), fake_process_reactor())
        self.entry = self.successResultOf(ensureDeferred(self.registry.resolve("x")))

    def unreadable(self, call: Coroutine[Any, Any, Any]) -> ModelUnreadable:
        f = self.failureResultOf(ensureDeferred(call), ModelUnreadable)
        error = f.value
        self.assertIsInstance(error, GGUFError)
        self.assertTrue(str(error).startswith('model "x:latest": its file '), str(error))
        self.assertNotIn(str(self.dir), str(error))
        self.assertNotIn("x.gguf", str(error))
        self.assertEqual((error.model, error.path, error.log_detail), ("x:latest", self.path, f"file {self.path}"))
        return error

    def test_no_read_permission(self) -> None:
        """
        The reader meets EACCES (as on a file of mode 000, unless root).
        """

        def read(path: Path, shards: tuple[Path, ...]) -> GGUFMetadata:
            raise unreadable(path, PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path)))

        self.registry._read = read
        error = self.unreadable(self.registry.metadata(self.entry))
        self.assertEqual(
            str(error),
            'model "x:latest": its file cannot be read (Permission denied); check the '
            "file's permissions: the daemon's user must be able to read it (the daemon log names "
            "the file)",
        )

    def test_not_gguf(self) -> None:
        self.path.write_bytes(b"not a model" * 10)
        self.assertIn("is not a readable GGUF file", str(self.unreadable(self.registry.metadata(self.entry))))

    def test_gone(self) -> None:
        """
        A file gone since the scan: its metadata and its digest.
        """
        self.path.unlink()
        for call in (self.registry.metadata(self.entry), self.registry.digest(self.entry)):
            self.assertIn("moved or deleted", str(self.unreadable(call)))


class HubNameTests(SynchronousTestCase):
    def test_pulled_files_are_named_as_ollama_names_them(self) -> None:
        root = Path(self.mktemp())
        touch(root / "hf.co" / "bartowski" / "Qwen-GGUF" / "Q4_K_M.gguf")
        touch(root / "hf.co" / "bartowski" / "Qwen-GGUF" / "latest.gguf")
        touch(root / ".partial" / "x.gguf")
        names = sorted(e.name for e in thd_scan(root, {}).values())
        self.assertEqual(names, ["hf.co/bartowski/Qwen-GGUF:Q4_K_M", "hf.co/bartowski/Qwen-GGUF:latest"])

    def test_tagged_alias_file(self) -> None:
        root = Path(self.mktemp())
        touch(root / "mine:v2.gguf")
        self.assertEqual([e.name for e in thd_scan(root, {}).values()], ["mine:v2"])


class AdapterTests(SynchronousTestCase):
    """
    A model's LoRA adapters (C{lora = [...]}, L{ModelEntry.adapters}) are
    checked as the supervisor reads its metadata, before a child is started
    with them: one that llama-server would refuse is an L{AdapterUnusable}
    naming the model and the fix, never the file.
    """

    def setUp(self) -> None:
        from blazar.models.testmodel import make_test_lora

        self.dir = Path(self.mktemp()).absolute()
        make_test_model(self.dir / "x.gguf")
        self.lora = make_test_lora(self.dir / "adapters" / "style.gguf")
        self.not_lora = make_test_model(self.dir / "adapters" / "model.gguf").path

    def registry(self, lora: str) -> ModelRegistry:
        return ModelRegistry(
            parse_config(f'models_dir = "{self.dir}"\n[models.x]\nlora = {lora}\n'), fake_process_reactor()
        )

    def test_the_config_sets_the_entrys_adapters(self) -> None:
        registry = self.registry('["adapters/style.gguf", {path = "adapters/style.gguf", scale = 0.5}]')
        entry = self.successResultOf(ensureDeferred(registry.resolve("x")))
        self.assertEqual(entry.adapters, ((self.lora, 1.0), (self.lora, 0.5)))
        self.assertEqual(self.successResultOf(ensureDeferred(registry.metadata(entry))).architecture, "llama")

    def test_a_file_that_is_no_adapter_is_a_teaching_error(self) -> None:
        from blazar.models.registry import AdapterUnusable

        registry = self.registry('["adapters/style.gguf", "adapters/model.gguf"]')
        entry = self.successResultOf(ensureDeferred(registry.resolve("x")))
        error = self.failureResultOf(ensureDeferred(registry.metadata(entry)), AdapterUnusable).value
        self.assertIsInstance(error, ModelUnreadable)  # rendered as the surfaces render an unreadable model
        self.assertTrue(
            str(error).startswith(
                'model "x:latest": LoRA adapter 2 of 2 is not a LoRA adapter GGUF '
                "(it has no general.type: a model file;"
            ),
            str(error),
        )
        self.assertIn("check its lora list", str(error))
        self.assertNotIn(str(self.dir), str(error))
        self.assertEqual(error.log_detail, f"file {self.not_lora}")

    def test_missing_or_for_another_architecture(self) -> None:
        from blazar.models.registry import AdapterUnusable
        from blazar.models.testmodel import make_test_lora

        registry = self.registry('["adapters/gone.gguf"]')
        entry = self.successResultOf(ensureDeferred(registry.resolve("x")))
        error = self.failureResultOf(ensureDeferred(registry.metadata(entry)), AdapterUnusable).value
        self.assertIn("LoRA adapter 1 of 1 cannot be read (No such file or directory)", str(error))
        make_test_lora(self.dir / "adapters" / "qwen.gguf", architecture="qwen2")
        registry = self.registry('["adapters/qwen.gguf"]')
        entry = self.successResultOf(ensureDeferred(registry.resolve("x")))
        error = self.failureResultOf(ensureDeferred(registry.metadata(entry)), AdapterUnusable).value
        self.assertIn("was made for architecture 'qwen2', and the model is 'llama'", str(error))

    def test_a_checked_file_is_not_read_again(self) -> None:
        from blazar.models.registry import thd_check_adapters

        checked = thd_check_adapters(((self.lora, 1.0),), "llama")
        st = self.lora.stat()
        self.lora.write_bytes(b"x" * st.st_size)  # what a read would refuse, under the same size and mtime
        os.utime(self.lora, ns=(st.st_atime_ns, st.st_mtime_ns))
        self.assertEqual(thd_check_adapters(((self.lora, 1.0),), "llama", checked), checked)
        os.utime(self.lora, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # changed: read again
        with self.assertRaises(GGUFError):
            thd_check_adapters(((self.lora, 1.0),), "llama", checked)


def test_an_alias_of_a_symlinked_model_is_the_file_itself(tmp_path: Path) -> None:
    """
    C{/api/copy} of a model that is a symlink (as the README links
    SmolLM2) makes a hard link of its file, not of the symlink.
    """
    from blazar.models.registry import thd_link

    real = tmp_path / "elsewhere" / "m.gguf"
    real.parent.mkdir()
    real.write_bytes(b"GGUF")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").symlink_to(real)
    thd_link(tmp_path / "models" / "m.gguf", tmp_path / "models" / "copy.gguf")
    assert not (tmp_path / "models" / "copy.gguf").is_symlink()
    assert (tmp_path / "models" / "copy.gguf").stat().st_ino == real.stat().st_ino
