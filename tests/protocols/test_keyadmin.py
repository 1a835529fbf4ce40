from pathlib import Path
from typing import Any, Callable, cast

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.logger import ILogObserver
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import ConfigError, load_config
from blazar.protocols.keyadmin import KeyAdmin
from blazar.testing import fake_process_reactor
from blazar.web.auth import KeyHolder
from tests.typed import not_none

TEXT = """# the operator's notes
listen = "tcp:1"  # inline comment

[[keys]]
name = "root"
secret = "root-secret-0123456789"
"""


class KeyAdminTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.dir.mkdir()
        self.path = self.dir / "config.toml"
        self.path.write_text(TEXT)
        self.holder = KeyHolder(load_config(self.path))
        self.admin = KeyAdmin(self.path, self.holder.live, fake_process_reactor())

    def run_change(self, plan: Callable[[Any], Any]) -> Deferred[Any]:
        return ensureDeferred(self.admin.change(plan))

    def test_add_rotate_remove_keep_comments_and_back_up(self) -> None:
        added = self.successResultOf(self.run_change(lambda a: a.add("alice", ["tiny"])))
        self.assertTrue(added["secret"].startswith("blz-"))
        self.assertIsNotNone(self.holder.find(added["secret"].encode()))
        text = self.path.read_text()
        self.assertIn("# the operator's notes", text)
        self.assertIn("# inline comment", text)
        self.assertEqual(len(list(self.dir.glob("config.toml.*.bak"))), 1)
        rotated = self.successResultOf(self.run_change(lambda a: a.rotate("alice")))
        self.assertIsNone(self.holder.find(added["secret"].encode()))
        self.assertEqual(not_none(self.holder.find(rotated["secret"].encode())).name, "alice")
        self.assertIn(rotated["secret"], self.path.read_text())
        self.successResultOf(self.run_change(lambda a: a.remove("alice")))
        self.assertEqual([k.name for k in self.holder.config.keys], ["root"])

    def test_last_admin_key_stays_while_scoped_keys_exist(self) -> None:
        self.successResultOf(self.run_change(lambda a: a.add("scoped", ["tiny"])))
        f = self.failureResultOf(self.run_change(lambda a: a.remove("root")), ConfigError)
        self.assertIn("last unscoped key", str(f.value))
        self.failureResultOf(self.run_change(lambda a: a.rotate("nobody")), ConfigError)
        self.failureResultOf(self.run_change(lambda a: a.add("root", [])), ConfigError)

    def test_failed_write_changes_nothing(self) -> None:
        before = self.path.read_bytes()
        keys_before = self.holder.config.keys
        # the temporary file's place is taken by a directory: the write fails
        # (works as root too, where mode bits would not stop it)
        (self.dir / ".config.toml.tmp").mkdir()
        f = self.failureResultOf(self.run_change(lambda a: a.rotate("root")), OSError)
        self.assertIsInstance(f.value, IsADirectoryError)
        self.assertEqual(self.path.read_bytes(), before)
        self.assertEqual(self.holder.config.keys, keys_before)
        self.assertEqual(list(self.dir.glob("*.bak")), [])

    def test_rewritten_file_and_backup_are_0600_whatever_the_umask(self) -> None:
        import os
        import stat

        old = os.umask(0)
        self.addCleanup(os.umask, old)
        os.chmod(self.path, 0o644)
        # a temporary file left by a crash, with a loose mode
        (self.dir / ".config.toml.tmp").write_text("")
        os.chmod(self.dir / ".config.toml.tmp", 0o666)
        self.successResultOf(self.run_change(lambda a: a.add("alice", [])))
        (backup,) = self.dir.glob("config.toml.*.bak")
        self.assertEqual(stat.S_IMODE(self.path.stat().st_mode), 0o600)
        self.assertEqual(stat.S_IMODE(backup.stat().st_mode), 0o600)
        self.assertEqual(backup.read_text(), TEXT)


class KeyChangeAppliesTheWholeFileTests(SynchronousTestCase):
    def test_hand_edits_are_swapped_in_with_the_key_and_logged(self) -> None:
        from twisted.logger import formatEvent, globalLogPublisher

        from blazar.config import LiveConfig

        root = Path(self.mktemp())
        root.mkdir()
        path = root / "config.toml"
        path.write_text(TEXT)
        live = LiveConfig(load_config(path))
        admin = KeyAdmin(path, live, fake_process_reactor())
        path.write_text("max_body_bytes = 1000\n" + TEXT)  # edited by hand, not reloaded
        events: list[dict] = []
        globalLogPublisher.addObserver(cast(ILogObserver, events.append))
        self.addCleanup(globalLogPublisher.removeObserver, cast(ILogObserver, events.append))
        self.successResultOf(ensureDeferred(admin.change(lambda a: a.add("alice", []))))
        self.assertEqual(live.current.max_body_bytes, 1000)
        self.assertEqual([k.name for k in live.current.keys], ["root", "alice"])
        (line,) = [formatEvent(e) for e in events if e.get("log_namespace") == "blazar.protocols.keyadmin"]
        self.assertIn("also applied: max_body_bytes; restart the daemon to apply: nothing", line)


class KeyIdentityTests(SynchronousTestCase):
    setUp = KeyAdminTests.setUp
    run_change: Callable[..., Deferred[Any]] = KeyAdminTests.run_change
    # set by the borrowed setUp
    holder: KeyHolder
    path: Path

    def test_a_key_added_under_a_removed_keys_name_is_another_owner(self) -> None:
        """
        Issue 36: files, batches and stored responses are filed under a
        key's L{KeyConfig.owner}; a key removed and added again under its
        name must not inherit them. Rotation keeps the owner; a key written
        without an id (before ids, or by hand) keeps its name as owner.
        """
        (root,) = self.holder.config.keys
        self.assertEqual(root.owner, "root")
        first = self.successResultOf(self.run_change(lambda a: a.add("alice", [])))
        alice = self.holder.find(first["secret"].encode())
        assert alice is not None and alice.id is not None
        self.assertEqual(alice.owner, f"alice#{alice.id}")
        self.assertIn(f'id = "{alice.id}"', self.path.read_text())
        rotated = self.successResultOf(self.run_change(lambda a: a.rotate("alice")))
        self.assertEqual(not_none(self.holder.find(rotated["secret"].encode())).owner, alice.owner)
        self.successResultOf(self.run_change(lambda a: a.remove("alice")))
        again = self.successResultOf(self.run_change(lambda a: a.add("alice", [])))
        later = self.holder.find(again["secret"].encode())
        assert later is not None
        self.assertEqual(later.name, "alice")
        self.assertNotEqual(later.owner, alice.owner)
        # a batch made by the removed key runs as nobody (its lines are refused), not as the new one
        self.assertIsNone(self.holder.named(alice.owner))
        self.assertIs(self.holder.named(later.owner), later)
        self.assertEqual(self.holder.named("root"), root)

    def test_ids_are_checked(self) -> None:
        from blazar.config import parse_config

        key = '[[keys]]\nname = "{name}"\nsecret = "{secret}"\nid = "{id}"\n'
        for bad in ("", "a b", "x" * 65):
            with self.assertRaises(ConfigError):
                parse_config(key.format(name="a", secret="s" * 16, id=bad))
        with self.assertRaises(ConfigError) as caught:
            parse_config(
                key.format(name="a", secret="s" * 16, id="k1") + key.format(name="b", secret="t" * 16, id="k1")
            )
        self.assertIn("reuses another key's id", str(caught.exception))
