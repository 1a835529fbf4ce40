"""
What L{thd_read_metadata} says of a file it cannot read: a L{GGUFError}
whose message names the file (for the daemon's log) and whose C{reason} and
C{hint}, which clients may be told, do not.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from blazar.models.gguf_meta import GGUFError, thd_read_metadata, unreadable
from blazar.models.testmodel import make_test_model


class UnreadableFileTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp()).absolute()
        self.dir.mkdir()

    def refused(self, path: Path, shards: tuple[Path, ...] = ()) -> GGUFError:
        error = self.assertRaises(GGUFError, thd_read_metadata, path, shards)
        self.assertEqual(error.path, path)
        self.assertEqual(str(error), f"{path}: {error.reason}")
        self.assertNotIn(str(self.dir), error.reason + error.hint)
        self.assertNotIn(path.name, error.reason + error.hint)
        return error

    def test_missing(self) -> None:
        error = self.refused(self.dir / "m.gguf")
        self.assertEqual(error.reason, "cannot be read (No such file or directory)")
        self.assertEqual(error.hint, "check that the file was not moved or deleted")

    def test_not_a_file(self) -> None:
        (self.dir / "m.gguf").mkdir()
        self.assertEqual(self.refused(self.dir / "m.gguf").reason, "cannot be read (Is a directory)")

    def test_no_read_permission(self) -> None:
        if os.geteuid() == 0:
            raise self.skipTest("root reads a file of mode 000")
        path = make_test_model(self.dir / "m.gguf").path
        os.chmod(path, 0)
        self.addCleanup(os.chmod, path, 0o644)
        error = self.refused(path)
        self.assertEqual(error.reason, "cannot be read (Permission denied)")
        self.assertIn("check the file's permissions", error.hint)

    def test_not_gguf(self) -> None:
        path = self.dir / "m.gguf"
        path.write_bytes(b"not a model, at all, not even close" * 4)
        error = self.refused(path)
        self.assertTrue(error.reason.startswith("is not a readable GGUF file"), error.reason)
        self.assertIn("pull the model again", error.hint)

    def test_missing_shard(self) -> None:
        first = make_test_model(self.dir / "big-00001-of-00002.gguf").path
        error = self.refused(first, (self.dir / "big-00002-of-00002.gguf",))
        self.assertEqual(
            error.reason, "has a missing or unreadable shard, big-00002-of-00002.gguf (No such file or directory)"
        )

    def test_readable(self) -> None:
        path = make_test_model(self.dir / "m.gguf").path
        self.assertEqual(thd_read_metadata(path).architecture, "llama")


class UnreadableTests(SynchronousTestCase):
    def test_hint_by_errno(self) -> None:
        """
        L{unreadable} takes the system's words, which hold no path, and
        hints by the kind of error.
        """
        path = Path("/srv/models/m.gguf")
        for error, hint in [
            (PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path)), "permissions"),
            (FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path)), "moved or deleted"),
            (OSError(errno.EIO, os.strerror(errno.EIO), str(path)), "check the file"),
            (OSError("no errno"), "check the file"),
        ]:
            made = unreadable(path, error)
            self.assertEqual(made.path, path)
            self.assertIn(hint, made.hint)
            self.assertNotIn("/srv", made.reason + made.hint)
        self.assertEqual(unreadable(path, OSError("no errno")).reason, "cannot be read (OSError)")


class TensorBytesTests(SynchronousTestCase):
    """
    The per-layer weight bytes and KV-cache facts the placement planner
    needs (L{blazar.engines.planner.estimate_need}).
    """

    def setUp(self) -> None:
        self.dir = Path(self.mktemp()).absolute()
        self.dir.mkdir()

    def test_generated_model(self) -> None:
        """
        L{make_test_model}'s tensors are all f32 with known shapes: each
        block holds two norms, four attention and three feed-forward
        matrices; outside the blocks are the embedding, the output norm
        and the output head.
        """
        from blazar.models.testmodel import vocabulary

        n_vocab = len(vocabulary()[0])
        for n_layer, n_embd, n_head, n_ff in [(2, 64, 4, 128), (3, 32, 2, 96)]:
            path = make_test_model(
                self.dir / f"m{n_layer}.gguf", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_ff=n_ff
            ).path
            meta = thd_read_metadata(path)
            block = 4 * (2 * n_embd + 4 * n_embd * n_embd + 3 * n_ff * n_embd)
            self.assertEqual(meta.layer_bytes, (block,) * n_layer)
            self.assertEqual(meta.input_bytes, 4 * n_vocab * n_embd)
            self.assertEqual(meta.output_bytes, 4 * (n_embd + n_vocab * n_embd))
            self.assertEqual(meta.other_bytes, meta.input_bytes + meta.output_bytes)
            self.assertEqual(sum(meta.layer_bytes) + meta.other_bytes, 4 * meta.parameter_count)
            self.assertEqual(meta.head_counts_kv, (n_head,) * n_layer)
            self.assertEqual((meta.key_length, meta.value_length), (n_embd // n_head, n_embd // n_head))
            self.assertEqual(meta.feed_forward_length, n_ff)
            self.assertEqual(meta.head_count_max, n_head)
            self.assertEqual(meta.vocab_size, n_vocab)
            self.assertEqual((meta.sliding_window, meta.swa_layers), (None, ()))

    def write(self, arch: str, n_layer: int, **keys: int | list[bool]) -> Path:
        """
        A GGUF of C{arch} with a tied output head (no C{output.weight}),
        per-layer KV heads and the extra C{keys} (C{name: value}).
        """
        import numpy as np
        from gguf import GGUFWriter

        path = self.dir / f"{arch}.gguf"
        writer = GGUFWriter(str(path), arch)
        writer.add_block_count(n_layer)
        writer.add_embedding_length(32)
        writer.add_head_count(4)
        writer.add_array(f"{arch}.attention.head_count_kv", [2, 1] * (n_layer // 2) + [2] * (n_layer % 2))
        writer.add_key_length(16)
        writer.add_value_length(8)
        for key, value in keys.items():
            if isinstance(value, list):
                writer.add_array(f"{arch}.{key}", value)
            else:
                writer.add_uint32(f"{arch}.{key}", value)
        writer.add_tensor("token_embd.weight", np.zeros((10, 32), dtype=np.float32))
        writer.add_tensor("output_norm.weight", np.zeros(32, dtype=np.float32))
        for i in range(n_layer):
            writer.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((32, 32 + i), dtype=np.float16))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    def test_tied_head_kv_arrays_and_sliding_window(self) -> None:
        """
        A tied output head counts the embedding again on the output side;
        per-layer KV heads and separate K/V head sizes are kept; the
        sliding-window layers follow the file's pattern or, without one,
        llama.cpp's for the architecture, and only with a window.
        """
        cases: list[tuple[str, dict[str, int | list[bool]], tuple[bool, ...]]] = [
            ("llama", {}, ()),
            ("gemma3", {}, ()),  # no window: every layer full size
            ("gemma3", {"attention.sliding_window": 512}, (True,) * 5 + (False,) + (True,) * 2),
            ("gemma2", {"attention.sliding_window": 4096}, (True, False) * 4),
            (
                "gemma3",
                {"attention.sliding_window": 512, "attention.sliding_window_pattern": 4},
                (True, True, True, False) * 2,
            ),
            (
                "gemma3",
                {"attention.sliding_window": 512, "attention.sliding_window_pattern": [True, False] * 4},
                (True, False) * 4,
            ),
            ("mistral", {"attention.sliding_window": 4096}, ()),  # not known here: full size, the safe answer
        ]
        for arch, keys, swa in cases:
            meta = thd_read_metadata(self.write(arch, 8, **keys))
            self.assertEqual(meta.swa_layers, swa, (arch, keys))
            self.assertEqual(meta.layer_bytes, tuple(2 * 32 * (32 + i) for i in range(8)))
            self.assertEqual(meta.input_bytes, 4 * 10 * 32)
            self.assertEqual(meta.output_bytes, 4 * 32 + 4 * 10 * 32)
            self.assertEqual(meta.other_bytes, 4 * 32 + 4 * 10 * 32)
            self.assertEqual(meta.head_counts_kv, (2, 1) * 4)
            self.assertEqual((meta.key_length, meta.value_length), (16, 8))

    def test_smollm2(self) -> None:
        """
        On a real model, the blocks and the rest add up to the file's
        tensor data. Skipped where the model was not downloaded.
        """
        path = Path.home() / ".cache/blazar/models/SmolLM2-135M-Instruct.gguf"
        if not path.exists():
            raise self.skipTest(f"{path} is absent")
        from gguf import GGUFReader

        meta = thd_read_metadata(path)
        reader = GGUFReader(str(path), "r")
        data = meta.size - reader.data_offset
        total = sum(meta.layer_bytes) + meta.other_bytes
        self.assertLessEqual(total, data)
        self.assertLess(data - total, 32 * len(reader.tensors))  # alignment padding at most
        self.assertEqual(len(meta.layer_bytes), meta.block_count)
        self.assertEqual(len(set(meta.layer_bytes)), 1)
        self.assertEqual(meta.head_counts_kv, (meta.head_count_kv,) * 30)
        # its output head is tied to the embedding: llama.cpp loads it twice
        self.assertGreater(meta.output_bytes, meta.input_bytes)
