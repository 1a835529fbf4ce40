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
        self.assertEqual(error.reason, "has a missing or unreadable shard, big-00002-of-00002.gguf "
                                       "(No such file or directory)")

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
