"""
Private files and directories (L{blazar.files}) and the files Blazar keeps
private with them: the database and its WAL/SHM, and the Batch API's file
contents beside it (L{blazar.store}). Each test runs under the loosest
umask (0), so a mode that holds was set explicitly, and again under the
usual 022.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from blazar import store
from blazar.files import open_private, private_dir, set_mode
from tests.typed import TestCaseMixin


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


class UmaskMixin(TestCaseMixin):
    umask = 0

    def setUp(self) -> None:
        old = os.umask(self.umask)
        self.addCleanup(os.umask, old)
        self.root = Path(self.mktemp())
        self.root.mkdir()


class PrivateFileTests(UmaskMixin, SynchronousTestCase):
    def test_new_directory_is_0700_and_reports_nothing(self) -> None:
        self.assertIsNone(private_dir(self.root / "data"))
        self.assertEqual(mode(self.root / "data"), 0o700)

    def test_an_open_directory_is_tightened(self) -> None:
        (self.root / "data").mkdir()
        os.chmod(self.root / "data", 0o755)
        self.assertEqual(private_dir(self.root / "data"), 0o755)
        self.assertEqual(mode(self.root / "data"), 0o700)
        self.assertIsNone(private_dir(self.root / "data"))

    def test_new_file_is_0600_before_anything_is_written(self) -> None:
        fd = open_private(self.root / "f", os.O_WRONLY)
        try:
            self.assertEqual(stat.S_IMODE(os.fstat(fd).st_mode), 0o600)
        finally:
            os.close(fd)

    def test_an_existing_open_file_is_tightened_and_kept(self) -> None:
        path = self.root / "f"
        path.write_text("old")
        os.chmod(path, 0o644)
        os.close(open_private(path, os.O_RDONLY))
        self.assertEqual((mode(path), path.read_text()), (0o600, "old"))

    def test_set_mode_on_a_missing_path_does_nothing(self) -> None:
        self.assertIsNone(set_mode(self.root / "nothing", 0o600))


class PrivateFileUsualUmaskTests(PrivateFileTests):
    umask = 0o022


class DatabaseModeTests(UmaskMixin, SynchronousTestCase):
    def wal_and_shm(self, path: Path) -> list[Path]:
        return [path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]

    def test_database_wal_and_shm_are_0600(self) -> None:
        path = self.root / "data" / "blazar.db"
        db = store.thd_open(path)
        self.addCleanup(db.close)
        store.thd_add_usage(db, [("2025-01-01", "k", 3)])
        # SQLite gives the WAL and SHM files the main file's mode
        self.assertEqual([mode(p) for p in [path, *self.wal_and_shm(path)]], [0o600] * 3)
        self.assertEqual(mode(path.parent), 0o700)  # made here: private

    def test_open_files_from_an_older_version_are_tightened(self) -> None:
        path = self.root / "blazar.db"
        store.thd_open(path).close()
        os.chmod(self.root, 0o755)
        leftovers = self.wal_and_shm(path)
        for p in [path, *leftovers]:
            if not p.exists():
                p.write_bytes(b"")
            os.chmod(p, 0o644)
        db = store.thd_open(path)
        self.addCleanup(db.close)
        self.assertEqual(store.thd_day_usage(db, "2025-01-01"), {})
        self.assertEqual([mode(p) for p in [path, *leftovers]], [0o600] * 3)
        self.assertEqual(mode(self.root), 0o755)  # an existing parent is the service's to set

    def test_batch_file_contents_are_0600_in_a_0700_directory(self) -> None:
        path = self.root / "data" / "blazar.db"
        db = store.thd_open(path)
        self.addCleanup(db.close)
        store.thd_put_file(db, ("file-a", "k", "in.jsonl", "batch", 1, b"{}\n"))
        self.assertEqual((mode(path.parent / "files"), mode(path.parent / "files" / "file-a")), (0o700, 0o600))


class DatabaseModeUsualUmaskTests(DatabaseModeTests):
    umask = 0o022
