"""
API keys every node of a cluster shares (C{[cluster] database}, issue 42):
the store's functions on SQLite and on a real PostgreSQL
(L{blazar.store.thd_shared_keys} and its siblings), the poll that reads
them on each node (L{blazar.storeservice.SharedKeys}, driven by a
L{Clock}), the door's merge of them with the config file's keys
(L{blazar.web.auth.KeyHolder}), where L{blazar.protocols.keyadmin.KeyAdmin}
sends each change, and the control socket's key commands.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from pathlib import Path
from typing import Any, Callable, cast

import attrs
from twisted.internet.defer import Deferred, ensureDeferred, fail
from twisted.logger import ILogObserver, LogLevel, formatEvent, globalLogPublisher
from twisted.protocols import amp
from twisted.python.threadpool import ThreadPool
from twisted.test.iosim import connectedServerAndClient
from twisted.trial.unittest import SynchronousTestCase

from blazar import store
from blazar.config import ConfigError, LiveConfig, load_config, parse_config
from blazar.postgres import StoreUnavailable
from blazar.protocols.keyadmin import KeyAdmin
from blazar.storeservice import FULL_READ_POLLS, SharedKeys, StoreService
from blazar.testing import SynchronousThreadPool, fake_process_reactor
from blazar.web.auth import KeyHolder
from tests import postgres
from tests.postgres import PostgresStore, SQLiteStore, StoreMixin
from tests.typed import not_none

ROOT = "root-secret-0123456789"
TEAM = "blz-team-secret-0123456789"
TEXT = f'[[keys]]\nname = "root"\nsecret = "{ROOT}"\n'


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def row(
    name: str, secret: str, settings: dict[str, Any] | None = None, key_id: str = "id0", changed: float = 10.0
) -> store.SharedKeyRow:
    return (name, key_id, digest(secret), secret[-4:], json.dumps(settings or {}), changed)


class SharedKeyStoreContract(StoreMixin):
    def setUp(self) -> None:
        self.db = self.open_store()

    def test_added_keys_are_read_back_with_a_version_that_moves(self) -> None:
        self.assertEqual(store.thd_shared_keys(self.db), (0, []))
        store.thd_add_shared_key(self.db, row("team", TEAM, {"models": ["tiny"], "rpm": 5}))
        team = row("team", TEAM, {"models": ["tiny"], "rpm": 5})
        self.assertEqual(store.thd_shared_keys(self.db), (1, [team]))
        self.assertIsNone(store.thd_shared_keys_since(self.db, 1))  # nothing changed: one integer read
        self.assertEqual(store.thd_shared_keys_since(self.db, 0), (1, [team]))
        self.assertEqual(store.thd_shared_keys_since(self.db, None), (1, [team]))

    def test_a_name_or_a_secret_is_added_once(self) -> None:
        store.thd_add_shared_key(self.db, row("team", TEAM))
        with self.assertRaises(store.SharedKeyRefused) as cm:
            store.thd_add_shared_key(self.db, row("team", "another-secret-0123456789", key_id="id1"))
        self.assertIn("a key named 'team' exists", str(cm.exception))
        with self.assertRaises(store.SharedKeyRefused):
            store.thd_add_shared_key(self.db, row("other", TEAM, key_id="id1"))
        self.assertEqual(store.thd_shared_keys(self.db), (1, [row("team", TEAM)]))  # the refusals changed nothing

    def test_a_rotation_keeps_the_id_and_settings(self) -> None:
        store.thd_add_shared_key(self.db, row("team", TEAM, {"tpm": 9}, key_id="abc"))
        new = "blz-new-secret-0123456789xyz"
        store.thd_rotate_shared_key(self.db, "team", digest(new), new[-4:], 20.0)
        self.assertEqual(
            store.thd_shared_keys(self.db), (2, [row("team", new, {"tpm": 9}, key_id="abc", changed=20.0)])
        )
        with self.assertRaises(store.SharedKeyRefused) as cm:
            store.thd_rotate_shared_key(self.db, "nobody", digest(new), "abcd", 21.0)
        self.assertIn("no key named 'nobody'", str(cm.exception))
        self.assertEqual(store.thd_shared_keys_version(self.db), 2)

    def test_the_last_unscoped_key_stays_while_scoped_keys_remain(self) -> None:
        store.thd_add_shared_key(self.db, row("admin", TEAM))
        store.thd_add_shared_key(self.db, row("scoped", "scoped-secret-0123456789", {"models": ["tiny"]}, "id1"))
        with self.assertRaises(store.SharedKeyRefused) as cm:
            store.thd_remove_shared_key(self.db, "admin", False, False)
        self.assertIn("last unscoped key", str(cm.exception))
        # a node's own unscoped key can manage them
        store.thd_remove_shared_key(self.db, "admin", True, False)
        self.assertEqual([r[0] for r in store.thd_shared_keys(self.db)[1]], ["scoped"])
        with self.assertRaises(store.SharedKeyRefused):
            store.thd_remove_shared_key(self.db, "nobody", True, False)
        store.thd_remove_shared_key(self.db, "scoped", False, False)  # a scoped key may always go
        self.assertEqual(store.thd_shared_keys(self.db), (4, []))

    def test_an_unscoped_shared_key_is_not_the_last_while_a_node_has_scoped_ones(self) -> None:
        store.thd_add_shared_key(self.db, row("admin", TEAM))
        with self.assertRaises(store.SharedKeyRefused):
            store.thd_remove_shared_key(self.db, "admin", False, True)
        store.thd_remove_shared_key(self.db, "admin", False, False)  # no key left at all: allowed


class SQLiteSharedKeyStoreTests(SQLiteStore, SharedKeyStoreContract, SynchronousTestCase):
    pass


class PostgresSharedKeyStoreTests(PostgresStore, SharedKeyStoreContract, SynchronousTestCase):
    pass


class PostgresSharedKeyNodesTests(PostgresStore, SynchronousTestCase):
    """
    Two connections to one database, as two nodes hold.
    """

    def test_a_change_on_one_node_is_read_on_the_other(self) -> None:
        a, b = self.open_stores(2)
        version, _ = store.thd_shared_keys(b)
        store.thd_add_shared_key(a, row("team", TEAM))
        self.assertEqual(store.thd_shared_keys_since(b, version), (version + 1, [row("team", TEAM)]))

    def test_nodes_adding_one_name_at_once_add_it_once(self) -> None:
        nodes = self.open_stores(2)
        outcomes: list[str] = []
        start = threading.Barrier(6)

        def add(n: int) -> None:
            start.wait(30)
            try:
                store.thd_add_shared_key(nodes[n % 2], row("team", f"secret-number-{n}-0123456789", key_id=f"id{n}"))
                outcomes.append("added")
            except store.SharedKeyRefused:
                outcomes.append("refused")

        threads = [threading.Thread(target=add, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertEqual(sorted(outcomes), ["added"] + ["refused"] * 5)
        version, rows = store.thd_shared_keys(nodes[1])
        self.assertEqual((version, [r[0] for r in rows]), (1, ["team"]))


class FlakyStore(StoreService):
    """
    The SQLite store service, whose calls fail as an unreachable PostgreSQL's
    do while C{down}, or with C{error} (a bug) when set.
    """

    down = False
    error: Exception | None = None

    def run_db(self, f: Callable[..., Any], *args: Any) -> Deferred[Any]:
        if self.down:
            return fail(StoreUnavailable("PostgreSQL at db.lan:5432 is unreachable: connection refused"))
        if self.error is not None:
            return fail(self.error)
        return super().run_db(f, *args)


class SharedKeysFixture(SynchronousTestCase):
    """
    A node: its config file (one key, C{root}), its store (SQLite, whose
    shared_keys table is the one PostgreSQL has), the poll, the door's
    holder and the key admin; and C{other}, a second connection to the
    same store, as another node writes to it.
    """

    def setUp(self) -> None:
        root = Path(self.mktemp())
        root.mkdir()
        self.path = root / "config.toml"
        self.path.write_text(TEXT)
        self.live = LiveConfig(load_config(self.path))
        self.clock = fake_process_reactor()
        self.database = FlakyStore(root / "blazar.db", self.clock, cast(ThreadPool, SynchronousThreadPool()))
        self.database.startService()
        self.addCleanup(self.database.stopService)
        self.other = store.thd_open(root / "blazar.db")
        self.addCleanup(self.other.close)
        self.shared = SharedKeys(self.database, self.live, self.clock, interval=1.0, wall=lambda: 50.0)
        self.holder = KeyHolder(self.live, shared=lambda: self.shared.keys)
        self.admin = KeyAdmin(self.path, self.live, self.clock, shared=self.shared, wall=lambda: 40.0)
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(cast(ILogObserver, self.events.append))
        self.addCleanup(globalLogPublisher.removeObserver, cast(ILogObserver, self.events.append))

    def start(self) -> None:
        self.shared.startService()
        self.addCleanup(self.shared.stopService)

    def logged(self, text: str, level: LogLevel | None = None) -> int:
        return sum(
            1
            for e in self.events
            if e.get("log_namespace") == "blazar.storeservice"
            and text in formatEvent(e)
            and (level is None or e.get("log_level") == level)
        )

    def change(self, plan: Callable[[Any], Any]) -> Deferred[dict[str, Any]]:
        return ensureDeferred(self.admin.change(plan))


class SharedKeysPollTests(SharedKeysFixture):
    def test_the_keys_in_the_store_at_start_are_used_before_any_poll(self) -> None:
        store.thd_add_shared_key(self.other, row("team", TEAM))
        self.start()
        self.assertEqual(not_none(self.holder.find(TEAM.encode())).name, "team")

    def test_a_key_added_or_removed_elsewhere_counts_here_within_one_interval(self) -> None:
        self.start()
        store.thd_add_shared_key(self.other, row("team", TEAM, {"models": ["tiny"]}))
        self.assertIsNone(self.holder.find(TEAM.encode()))
        self.clock.advance(1.0)
        team = not_none(self.holder.find(TEAM.encode()))
        self.assertEqual((team.name, team.models, team.owner), ("team", ("tiny:latest",), "team#id0"))
        self.assertIs(self.holder.named("team#id0"), team)  # (a batch line runs as it)
        new = "blz-rotated-secret-0123456789"
        store.thd_rotate_shared_key(self.other, "team", digest(new), new[-4:], 11.0)
        self.clock.advance(1.0)
        self.assertIsNone(self.holder.find(TEAM.encode()))
        self.assertEqual(not_none(self.holder.find(new.encode())).owner, "team#id0")
        store.thd_remove_shared_key(self.other, "team", True, False)
        self.clock.advance(1.0)
        self.assertIsNone(self.holder.find(new.encode()))
        self.assertEqual([k.name for k in self.holder._keys], ["root"])

    def test_nothing_is_read_again_while_the_version_stays(self) -> None:
        store.thd_add_shared_key(self.other, row("team", TEAM))
        self.start()
        keys = self.shared.keys
        for _ in range(FULL_READ_POLLS + 1):  # (a full read among them)
            self.clock.advance(1.0)
        self.assertIs(self.shared.keys, keys)  # the same tuple: the door's tables are not made again

    def test_a_version_that_went_back_is_read_and_a_full_read_catches_a_hidden_change(self) -> None:
        """
        A failover to a replica that lagged, or a restored backup, can move
        the version back: a lower version is read like a higher one, and a
        change that lands on the very number this node last read is read
        by the full read every L{FULL_READ_POLLS} polls.
        """

        def set_version(version: int) -> None:
            with self.other:
                self.other.execute("UPDATE shared_keys_version SET version = ?", (version,))

        store.thd_add_shared_key(self.other, row("team", TEAM))
        self.start()
        seen = store.thd_shared_keys_version(self.other)
        store.thd_remove_shared_key(self.other, "team", True, False)
        set_version(seen - 1)  # lower than what this node read
        self.clock.advance(1.0)
        self.assertIsNone(self.holder.find(TEAM.encode()))
        store.thd_add_shared_key(self.other, row("team", TEAM))
        set_version(seen - 1)  # the same number as last read: the version says nothing changed
        for _ in range(FULL_READ_POLLS - 2):
            self.clock.advance(1.0)
        self.assertIsNone(self.holder.find(TEAM.encode()))
        self.clock.advance(1.0)
        self.clock.advance(1.0)
        self.assertEqual(not_none(self.holder.find(TEAM.encode())).name, "team")

    def test_a_shared_keys_scope_and_limits_are_a_config_keys(self) -> None:
        limits = {"models": ["tiny"], "rpm": 2, "tpm": 20, "daily_tokens": 50, "max_concurrent": 1, "weight": 2.5}
        store.thd_add_shared_key(self.other, row("team", TEAM, {**limits, "sentinel_enforce": True, "cache": False}))
        self.start()
        shared = not_none(self.holder.find(TEAM.encode()))
        (written,) = parse_config(
            f'[[keys]]\nname = "team"\nsecret = "{TEAM}"\nid = "id0"\nmodels = ["tiny"]\nrpm = 2\ntpm = 20\n'
            "daily_tokens = 50\nmax_concurrent = 1\nweight = 2.5\nsentinel_enforce = true\ncache = false\n"
        ).keys
        self.assertEqual(shared, attrs.evolve(written, secret=shared.secret))
        self.assertFalse(shared.admin)

    def test_a_shared_keys_secret_field_is_no_secret(self) -> None:
        store.thd_add_shared_key(self.other, row("team", TEAM))
        self.start()
        shared = not_none(self.holder.find(TEAM.encode()))
        self.assertTrue(shared.secret.endswith(TEAM[-4:]))  # listings show "...<last 4>"
        self.assertNotIn(TEAM, shared.secret)
        self.assertIsNone(self.holder.find(shared.secret.encode()))
        self.assertIsNone(self.holder.find(digest(TEAM).encode()))

    def test_an_outage_keeps_the_last_keys_read_and_is_logged_once(self) -> None:
        self.start()
        store.thd_add_shared_key(self.other, row("team", TEAM))
        self.clock.advance(1.0)
        self.database.down = True
        store.thd_remove_shared_key(self.other, "team", True, False)
        for _ in range(5):
            self.clock.advance(1.0)
        self.assertIsNotNone(self.holder.find(TEAM.encode()))  # the last set read
        self.assertEqual(self.logged("keeps the 1 it last read", LogLevel.error), 1)
        self.assertEqual(self.logged("PostgreSQL at db.lan:5432 is unreachable"), 1)
        self.database.down = False
        self.clock.advance(1.0)
        self.assertIsNone(self.holder.find(TEAM.encode()))
        self.assertEqual(self.logged("read again"), 1)

    def test_the_poll_survives_a_failure(self) -> None:
        self.start()
        self.database.error = RuntimeError("a bug")
        self.clock.advance(1.0)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.database.error = None
        store.thd_add_shared_key(self.other, row("team", TEAM))
        self.clock.advance(1.0)
        self.assertIsNotNone(self.holder.find(TEAM.encode()))

    def test_a_row_this_blazar_cannot_read_is_left_out(self) -> None:
        store.thd_add_shared_key(self.other, row("team", TEAM))
        store.thd_add_shared_key(self.other, row("odd", "odd-secret-0123456789", {"rpm": "lots"}, key_id="id1"))
        store.thd_add_shared_key(self.other, row("new", "new-secret-0123456789", {"colour": 1}, key_id="id2"))
        self.start()
        self.assertEqual([s.key.name for s in self.shared.keys], ["team"])
        self.assertEqual(self.logged("the shared key 'odd' is left out", LogLevel.error), 1)
        self.assertEqual(self.logged("unknown key 'colour'"), 1)

    def test_a_config_file_key_wins_a_name_both_hold(self) -> None:
        store.thd_add_shared_key(self.other, row("root", TEAM))  # (only a hand edit or an older node makes one)
        self.start()
        self.assertIsNone(self.holder.find(TEAM.encode()))
        self.assertEqual(not_none(self.holder.find(ROOT.encode())).name, "root")
        self.assertEqual(
            sum(1 for e in self.events if "is not used on this node" in formatEvent(e)), 1
        )  # (once per change, not per request)
        self.holder.find(ROOT.encode())
        self.assertEqual(sum(1 for e in self.events if "is not used on this node" in formatEvent(e)), 1)

    def test_stop_waits_for_the_poll_in_flight(self) -> None:
        self.start()
        self.successResultOf(self.shared.stopService())
        self.clock.advance(5.0)  # no poll after the stop
        self.assertEqual(self.clock.getDelayedCalls(), [])


class SharedKeyAdminTests(SharedKeysFixture):
    def setUp(self) -> None:
        super().setUp()
        self.start()

    def test_a_key_added_goes_to_the_shared_store_and_counts_at_once(self) -> None:
        before = self.path.read_text()
        added = self.successResultOf(self.change(lambda a: a.add("team", ["tiny"], {"rpm": 5, "tpm": None})))
        self.assertEqual(added["shared"], True)
        secret = added["secret"]
        team = not_none(self.holder.find(secret.encode()))  # no poll needed on the node that made it
        self.assertEqual((team.models, team.rpm, team.tpm), (("tiny:latest",), 5, None))
        self.assertEqual(self.path.read_text(), before)  # the config file is the node's own
        _, (stored,) = store.thd_shared_keys(self.other)
        self.assertEqual(stored[:4], ("team", team.id, digest(secret), secret[-4:]))
        self.assertEqual((json.loads(stored[4]), stored[5]), ({"models": ["tiny"], "rpm": 5}, 40.0))
        dump = "\n".join(self.other.iterdump())
        self.assertNotIn(secret, dump)  # only its SHA-256 is stored

    def test_a_config_file_keys_name_is_refused_with_the_fix(self) -> None:
        f = self.failureResultOf(self.change(lambda a: a.add("root", [])), ConfigError)
        self.assertIn("in this node's config file", str(f.value))
        self.assertIn("pick another name, or remove the config-file key first", str(f.value))
        self.successResultOf(self.change(lambda a: a.add("team", [])))
        f2 = self.failureResultOf(self.change(lambda a: a.add("team", [])), ValueError)
        self.assertIn("a key named 'team' exists", str(f2.value))

    def test_bad_limits_are_refused_as_the_config_file_would(self) -> None:
        f = self.failureResultOf(self.change(lambda a: a.add("team", [], {"rpm": 0})), ConfigError)
        self.assertIn("'rpm'", str(f.value))
        self.failureResultOf(self.change(lambda a: a.add("team", [], {"secret": "x" * 20})), ConfigError)
        self.failureResultOf(self.change(lambda a: a.add("team", ["bad name!"])), ConfigError)
        self.assertEqual(store.thd_shared_keys(self.other), (0, []))

    def test_rotate_and_remove_change_a_key_where_it_lives(self) -> None:
        first = self.successResultOf(self.change(lambda a: a.add("team", [])))["secret"]
        before = self.path.read_text()
        rotated = self.successResultOf(self.change(lambda a: a.rotate("team")))
        self.assertEqual(rotated["shared"], True)
        self.assertIsNone(self.holder.find(first.encode()))
        self.assertEqual(not_none(self.holder.find(rotated["secret"].encode())).name, "team")
        self.assertEqual(self.path.read_text(), before)
        root = self.successResultOf(self.change(lambda a: a.rotate("root")))
        self.assertNotIn("shared", root)
        self.assertIn(root["secret"], self.path.read_text())  # a config-file key stays in its file
        self.assertIsNone(self.holder.find(ROOT.encode()))
        self.successResultOf(self.change(lambda a: a.remove("team")))
        self.assertIsNone(self.holder.find(rotated["secret"].encode()))
        self.failureResultOf(self.change(lambda a: a.remove("team")), ValueError)

    def test_the_last_unscoped_key_counts_both_kinds(self) -> None:
        self.successResultOf(self.change(lambda a: a.add("scoped", ["tiny"])))
        f = self.failureResultOf(self.change(lambda a: a.remove("root")), ConfigError)  # the file's, last unscoped
        self.assertIn("last unscoped key", str(f.value))
        self.successResultOf(self.change(lambda a: a.add("admin", [])))
        self.successResultOf(self.change(lambda a: a.remove("root")))  # a shared unscoped key remains
        f2 = self.failureResultOf(self.change(lambda a: a.remove("admin")), ValueError)
        self.assertIn("last unscoped key", str(f2.value))

    def test_listed_marks_the_shared_keys(self) -> None:
        secret = self.successResultOf(self.change(lambda a: a.add("team", ["tiny"], {"daily_tokens": 7})))["secret"]
        listed = self.admin.listed()
        self.assertEqual(
            [(k["name"], k["secret"], k["shared"], k["models"], k["daily_tokens"]) for k in listed],
            [("root", "..." + ROOT[-4:], False, [], None), ("team", "..." + secret[-4:], True, ["tiny:latest"], 7)],
        )

    def test_a_change_while_the_store_is_down_fails_naming_it(self) -> None:
        self.database.down = True
        f = self.failureResultOf(self.change(lambda a: a.add("team", [])), StoreUnavailable)
        self.assertIn("PostgreSQL at db.lan:5432 is unreachable", str(f.value))
        self.assertNotIn("team", self.path.read_text())

    def test_a_blazar_keys_name_is_refused_and_counts_as_unscoped(self) -> None:
        from blazar.config import KeyConfig

        env = (KeyConfig("ops", "ops-secret-0123456789"),)
        admin = KeyAdmin(self.path, self.live, self.clock, shared=self.shared, extra=env)
        f = self.failureResultOf(ensureDeferred(admin.change(lambda a: a.add("ops", []))), ConfigError)
        self.assertIn("BLAZAR_KEYS", str(f.value))
        self.successResultOf(ensureDeferred(admin.change(lambda a: a.add("scoped", ["tiny"]))))
        self.successResultOf(ensureDeferred(admin.change(lambda a: a.add("admin", []))))
        self.path.write_text("")  # (root gone from the file: the env key is the node's unscoped one)
        self.successResultOf(ensureDeferred(admin.reload()))
        self.successResultOf(ensureDeferred(admin.change(lambda a: a.remove("admin"))))
        f2 = self.failureResultOf(
            ensureDeferred(
                KeyAdmin(None, self.live, self.clock, shared=self.shared).change(lambda a: a.remove("scoped2"))
            ),
            ValueError,
        )
        self.assertIn("no key named", str(f2.value))

    def test_without_a_config_file_shared_keys_are_managed(self) -> None:
        admin = KeyAdmin(None, self.live, self.clock, shared=self.shared)
        added = self.successResultOf(ensureDeferred(admin.change(lambda a: a.add("team", []))))
        self.assertIsNotNone(self.holder.find(added["secret"].encode()))
        self.failureResultOf(ensureDeferred(admin.change(lambda a: a.rotate("root"))), ConfigError)


class SharedKeyControlTests(SharedKeysFixture):
    """
    C{blazar keys} over the control socket (AMP), on a cluster node.
    """

    def setUp(self) -> None:
        super().setUp()
        self.start()
        from blazar.protocols.control import ControlServer

        self.client, self.server, self.pump = connectedServerAndClient(
            lambda: ControlServer(None, None, lambda: {}, self.clock, None, self.admin),  # type: ignore[arg-type]
            amp.AMP,
        )

    def call(self, command: Any, **kw: Any) -> Deferred[Any]:
        result: list[Any] = []
        self.client.callRemote(command, **kw).addBoth(result.append)
        self.pump.flush()
        (value,) = result
        d: Deferred[Any] = Deferred()
        d.callback(value)
        return d

    def test_add_with_limits_list_rotate_remove(self) -> None:
        from blazar.protocols.control import KeyError_, KeysAdd, KeysList, KeysRemove, KeysRotate

        added = self.successResultOf(self.call(KeysAdd, name="team", models=["tiny"], rpm=3, weight=2.0))
        self.assertTrue(added["shared"])
        team = not_none(self.holder.find(added["secret"].encode()))
        self.assertEqual((team.rpm, team.weight), (3, 2.0))
        keys = self.successResultOf(self.call(KeysList))["keys"]
        self.assertEqual([(k["name"], k["shared"]) for k in keys], [("root", False), ("team", True)])
        self.assertNotIn(added["secret"], repr(keys))
        f = self.failureResultOf(self.call(KeysAdd, name="root"), KeyError_)
        self.assertIn("config file", str(f.value))
        self.failureResultOf(self.call(KeysAdd, name="x", rpm=0), KeyError_)
        rotated = self.successResultOf(self.call(KeysRotate, name="team"))
        self.assertTrue(rotated["shared"])
        self.assertEqual(self.successResultOf(self.call(KeysRemove, name="team"))["name"], "team")
        self.assertIsNone(self.holder.find(rotated["secret"].encode()))

    def test_keys_list_pages_through_a_clusters_many_keys(self) -> None:
        """
        1,200 shared keys (over 64 KiB as one AMP value: the daemon raised
        C{TooLong} answering and dropped the control connection, found in
        review) are listed whole, a page at a time, each page one value
        that fits; C{blazar keys list} asks until the last.
        """
        from blazar.protocols.control import QUEUE_BUDGET, KeysList

        for i in range(1200):
            store.thd_add_shared_key(
                self.other,
                row(f"customer-{i:05d}", f"secret-number-{i:06d}-abcdefghijkl", {"models": ["tiny"]}, key_id=f"id{i}"),
            )
        self.clock.advance(1.0)
        self.assertEqual(len(self.shared.keys), 1200)
        first = self.successResultOf(self.call(KeysList))
        from blazar.cli.keys import every_key
        from blazar.protocols.control import KEY

        self.assertLess(len(amp.AmpList(KEY).toStringProto(first["keys"], None)), QUEUE_BUDGET)
        self.assertEqual(first["next_offset"], len(first["keys"]))
        result: list[Any] = []
        Deferred.fromCoroutine(every_key(cast(amp.AMP, self.client))).addBoth(result.append)
        self.pump.flush()
        (keys,) = result
        self.assertEqual([k["name"] for k in keys], ["root", *(f"customer-{i:05d}" for i in range(1200))])
        self.assertEqual(
            keys[-1],
            {
                "name": "customer-01199",
                "secret": "...ijkl",
                "models": ["tiny:latest"],
                "shared": True,
                "models_left_out": None,
            },
        )
        self.assertEqual(self.successResultOf(self.call(KeysList, offset=1199))["keys"], [keys[-2], keys[-1]])

    def test_a_key_whose_models_alone_overflow_a_value_keeps_those_that_fit(self) -> None:
        from blazar.protocols.control import KEY, QUEUE_BUDGET, page_keys

        models = [f"model-{i:05d}:latest" for i in range(5000)]
        huge = {"name": "wide", "secret": "...abcd", "models": models, "shared": True}
        small = {"name": "small", "secret": "...wxyz", "models": [], "shared": False}
        self.assertEqual(page_keys([small, huge, small], 0), ([small], 1))
        page, next_offset = page_keys([small, huge, small], 1)
        self.assertEqual(next_offset, 2)
        (cut,) = page
        kept = len(cut["models"])
        self.assertEqual((cut["models"], cut["models_left_out"]), (models[:kept], 5000 - kept))
        self.assertGreater(kept, 2500)  # as many as fit, not a halving's
        self.assertLess(len(amp.AmpList(KEY).toStringProto(page, None)), QUEUE_BUDGET)
        self.assertEqual(page_keys([small, huge, small], 2), ([small], None))

    def test_an_unreachable_store_is_a_key_error_naming_it(self) -> None:
        from blazar.protocols.control import KeyError_, KeysAdd

        self.database.down = True
        f = self.failureResultOf(self.call(KeysAdd, name="team"), KeyError_)
        self.assertIn("PostgreSQL at db.lan:5432 is unreachable", str(f.value))
        self.assertIn("[cluster] database", str(f.value))


class PostgresSharedKeysPollTests(SynchronousTestCase):
    """
    Two nodes' polls on one real PostgreSQL: a key added through one
    node's admin is used by the other after one interval.
    """

    def test_two_nodes(self) -> None:
        url = postgres.shared().new_database()
        clock = fake_process_reactor()
        nodes = []
        for n in range(2):
            root = Path(self.mktemp())
            root.mkdir()
            live = LiveConfig(parse_config(""))
            database = StoreService(root / "x.db", clock, cast(ThreadPool, SynchronousThreadPool()), url=url)
            database.startService()
            self.addCleanup(database.stopService)
            shared = SharedKeys(database, live, clock)
            shared.startService()
            self.addCleanup(shared.stopService)
            holder = KeyHolder(live, shared=functools.partial(getattr, shared, "keys"))
            nodes.append((KeyAdmin(None, live, clock, shared=shared), holder))
        (admin_a, holder_a), (_, holder_b) = nodes
        self.assertFalse(holder_b.active)
        secret = self.successResultOf(ensureDeferred(admin_a.change(lambda a: a.add("team", []))))["secret"]
        self.assertIsNotNone(holder_a.find(secret.encode()))
        self.assertIsNone(holder_b.find(secret.encode()))
        clock.advance(1.0)
        self.assertTrue(holder_b.active)
        self.assertEqual(not_none(holder_b.find(secret.encode())).name, "team")
