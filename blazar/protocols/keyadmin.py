"""
Changing API keys at runtime: the config file is the source of truth, so
every change goes parse → change → validate → atomic write (with a .bak),
under one lock, off the reactor thread; only then is the live config
(L{blazar.config.LiveConfig}) swapped. A failed validation or write changes
nothing, on disk or in memory. C{blazar reload} and SIGHUP go through the
same lock and the same swap.

With C{[cluster] database} (issue 42) the keys managed at run time are the
cluster's, not the node's: a key added goes to the store every node shares
(L{ISharedKeys}: the SHA-256 of its secret, never the secret), and every
node reads it within seconds; rotating or removing a key changes it where it
lives, the config file (a node's own C{[[keys]]}, as without a cluster) or
the shared store. A name both would hold is refused.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Union

import attrs
from twisted.internet.defer import DeferredLock
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from zope.interface import Attribute, Interface, implementer

from blazar import strictjson
from blazar.config import (
    Config,
    ConfigError,
    KeyConfig,
    LiveConfig,
    ReloadReport,
    SharedKey,
    load_config,
    shared_key,
    thd_rewrite,
)
from blazar.models.speculative import thd_check_drafts

log = Logger()


KEY_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def thd_load_checked(path: Path) -> Config:
    """
    Load the config file at C{path} (which must exist) and check what only
    files say: each draft model shares its model's vocabulary
    (L{thd_check_drafts}). Blocking: reads files.

    @raise ConfigError: As L{load_config} and L{thd_check_drafts}.
    """
    config = load_config(path, required=True)
    thd_check_drafts(config)
    return config


def new_secret() -> str:
    """
    A fresh key secret: C{blz-} and 40 URL-safe random characters.
    """
    return "blz-" + secrets.token_urlsafe(30)


LIMITS = ("max_concurrent", "rpm", "tpm", "daily_tokens", "weight")
"""The limits C{blazar keys add} and the dashboard may give a new key (its C{[[keys]]} fields)."""


class ISharedKeys(Interface):
    """
    The API keys every node of a cluster shares (C{[cluster] database}):
    the set this node last read, and the changes, written to the store
    (L{blazar.storeservice.SharedKeys}). A change fails with
    L{blazar.postgres.StoreUnavailable} while the store cannot be reached,
    and with L{blazar.store.SharedKeyRefused} (a L{ValueError}) when it
    cannot be made.
    """

    keys = Attribute("The shared keys last read: a tuple of L{SharedKey}, a new tuple at each change.")

    async def add(row: tuple[str, str, str, str, str, float]) -> None:
        """
        Add C{(name, id, digest hex, hint, settings JSON, changed)}; this
        node's set is read again before it returns.
        """

    async def rotate(name: str, digest: str, hint: str) -> None:
        """
        Give the key C{name} a new secret's digest and hint.
        """

    async def remove(name: str, local_unscoped: bool, local_scoped: bool) -> None:
        """
        Remove the key C{name}, unless it is the last unscoped one while
        scoped keys remain (the node's own keys counted as the flags say).
        """


@attrs.frozen
class SharedChange:
    """
    A change to the shared keys (L{ISharedKeys}) and its answer: what a
    plan gives L{KeyAdmin.change} instead of a config-file mutation.
    """

    apply: Callable[[], Awaitable[None]]
    answer: dict[str, Any]


Plan = Union[tuple[Callable[[Any], None], dict[str, Any]], SharedChange]


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


class IKeyAdmin(Interface):
    """
    Key changes and config reloads, as the control socket asks for them.
    """

    config = Attribute("The live config's current L{Config}.")

    async def change(plan: Callable[[Any], Plan]) -> dict[str, Any]:
        """
        Run C{plan(self)}: a change to the config file and the answer (the
        file is rewritten and the live config swapped), or a change to the
        shared keys (L{SharedChange}).
        """

    def listed() -> list[dict[str, Any]]:
        """
        Every key, the node's own (config file) then the shared ones:
        C{name}, C{secret} (its last 4 characters), C{models}, C{admin},
        C{rpm}, C{tpm}, C{daily_tokens}, C{shared}.
        """

    async def reload() -> ReloadReport:
        """
        Re-read the config file and swap it in whole.
        """


@implementer(IKeyAdmin)
class KeyAdmin:
    """
    Applies key changes and reloads of the config file to the file and the
    live config.

    @ivar config: The live config's current object (read by the control
        channel's list).
    """

    def __init__(
        self,
        path: Path | None,
        live: LiveConfig,
        reactor: Any,
        shared: ISharedKeys | None = None,
        wall: Any = time.time,
        extra: tuple[KeyConfig, ...] = (),
    ) -> None:
        """
        @param shared: The cluster's shared keys (C{[cluster] database}):
            keys added go there; L{None}, to the config file.
        @param extra: This node's keys from C{BLAZAR_KEYS} (never written
            anywhere): a shared key may not take their names either.
        """
        self._extra = extra
        self._path = path
        self._live = live
        self._reactor = reactor
        self._shared = shared
        self._wall = wall
        self._lock = DeferredLock()

    @property
    def config(self) -> Config:
        return self._live.current

    @property
    def shared(self) -> tuple[SharedKey, ...]:
        """
        The shared keys this node last read (none without a cluster).
        """
        return self._shared.keys if self._shared is not None else ()

    def listed(self) -> list[dict[str, Any]]:
        rows = []
        for key, shared in [*((k, False) for k in self.config.keys), *((s.key, True) for s in self.shared)]:
            rows.append(
                {
                    "name": key.name,
                    "secret": "..." + key.secret[-4:],
                    "models": list(key.models),
                    "admin": key.admin,
                    "rpm": key.rpm,
                    "tpm": key.tpm,
                    "daily_tokens": key.daily_tokens,
                    "shared": shared,
                }
            )
        return rows

    async def change(self, plan: Callable[["KeyAdmin"], Plan]) -> dict[str, Any]:
        """
        Run C{plan(self)}: a L{SharedChange}, applied to the shared keys;
        or (a tomlkit document mutation, the answer), run through the file
        round trip, then the file's new config swapped in whole.

        @raise ConfigError: Invalid change, or a file change on a daemon
            without a config file.
        @raise OSError: The write failed.
        @raise ValueError: A shared change refused
            (L{blazar.store.SharedKeyRefused}).
        @raise blazar.postgres.StoreUnavailable: A shared change while the
            store cannot be reached.
        """
        await self._lock.acquire()
        try:
            planned = plan(self)
            if isinstance(planned, SharedChange):
                await planned.apply()
                return planned.answer
            if self._path is None:
                raise ConfigError("this daemon runs without a config file: start it with --config PATH to manage keys")
            mutate, answer = planned
            config, _ = await deferToThreadPool(
                self._reactor, self._reactor.getThreadPool(), thd_rewrite, self._path, mutate, thd_check_drafts
            )
            report = self._live.swap(config)
            others = [k for k in report.applied if k != "keys"]
            if others or report.restart:
                # the operator had edited the file by hand since the last reload
                log.info(
                    "config file {path} rewritten for a key change; also applied: {applied}; "
                    "restart the daemon to apply: {restart}",
                    path=str(self._path),
                    applied=", ".join(others) or "nothing",
                    restart=", ".join(report.restart) or "nothing",
                )
            return answer
        finally:
            self._lock.release()

    async def reload(self) -> ReloadReport:
        """
        Re-read and validate the config file, then swap it in whole: every
        service reads the live config, so each runtime key applies from its
        next use; restart-only keys keep their running values.

        @return: The changed keys, applied and restart-only.
        @raise ConfigError: The file is missing or invalid; nothing changes.
        @raise OSError: The file cannot be read; nothing changes.
        """
        if self._path is None:
            raise ConfigError("this daemon runs without a config file: nothing to reload")
        await self._lock.acquire()
        try:
            new = await deferToThreadPool(self._reactor, self._reactor.getThreadPool(), thd_load_checked, self._path)
            return self._live.swap(new)
        finally:
            self._lock.release()

    def _find(self, doc: Any, name: str) -> Any:
        for table in doc.get("keys", []):
            if table.get("name") == name:
                return table
        raise ConfigError(f"no key named {name!r} (see `blazar keys list`)")

    def _in_file(self, name: str) -> bool:
        """
        Whether C{name} is a key of this node's config file (as last read).
        """
        return any(k.name == name for k in self.config.keys)

    def add(
        self, name: str, models: list[str], limits: Mapping[str, Any] | None = None
    ) -> tuple[Callable[[Any], None], dict[str, Any]] | SharedChange:
        """
        A new key C{name} (its secret in the answer, shown once), scoped to
        C{models} (none: every model, and admin rights), with C{limits}
        (L{LIMITS}: C{rpm}, C{tpm}, ...). On a cluster it is a shared key.

        @raise ConfigError: A bad name or limit, or (on a cluster) a name
            this node's config file holds.
        """
        if not KEY_NAME.fullmatch(name):
            raise ConfigError(
                f"a key's name is 1 to 64 letters, digits, '.', '_' or '-' (not {name[:80]!r}): it "
                "appears in logs, metrics and the dashboard"
            )
        given = {k: v for k, v in (limits or {}).items() if v is not None}
        for field in given:
            if field not in LIMITS:
                raise ConfigError(f"a new key's limits are {', '.join(LIMITS)}, not {field!r}")
        secret = new_secret()
        key_id = secrets.token_hex(6)  # its own: a key added later under this name owns none of its data
        if self._shared is not None:
            return self._add_shared(name, secret, key_id, {**({"models": models} if models else {}), **given})

        def mutate(doc: Any) -> None:
            import tomlkit

            if any(t.get("name") == name for t in doc.get("keys", [])):
                raise ConfigError(f"a key named {name!r} exists; rotate it or pick another name")
            table = tomlkit.table()
            table["name"] = name
            table["secret"] = secret
            table["id"] = key_id
            if models:
                table["models"] = models
            for field, value in given.items():
                table[field] = value
            if "keys" not in doc:
                doc["keys"] = tomlkit.aot()
            doc["keys"].append(table)

        return mutate, {"secret": secret}

    def _add_shared(self, name: str, secret: str, key_id: str, settings: dict[str, Any]) -> SharedChange:
        shared = self._shared
        assert shared is not None
        if any(k.name == name for k in self._extra):
            raise ConfigError(
                f"a key named {name!r} comes from this node's BLAZAR_KEYS, which only this node reads; a key "
                "added here is shared by every node of the cluster ([cluster] database), so it needs a name "
                "no node-local key has: pick another name"
            )
        if self._in_file(name):
            raise ConfigError(
                f"a key named {name!r} is in this node's config file ([[keys]]), which only this node "
                "reads; a key added here is shared by every node of the cluster ([cluster] database), so "
                "it needs a name no config-file key has: pick another name, or remove the config-file "
                "key first"
            )
        digest, hint = _digest(secret), secret[-4:]
        shared_key(name, key_id, digest, hint, settings, self.config.remotes)  # (checked as a [[keys]] entry is)
        row = (name, key_id, digest, hint, strictjson.encode(settings), float(self._wall()))
        return SharedChange(lambda: shared.add(row), {"secret": secret, "shared": True})

    def rotate(self, name: str) -> tuple[Callable[[Any], None], dict[str, Any]] | SharedChange:
        """
        A new secret for the key C{name} (in the answer, shown once): in
        the config file for a key of it, else in the shared store.
        """
        secret = new_secret()
        shared = self._shared
        if shared is not None and not self._in_file(name):
            return SharedChange(
                lambda: shared.rotate(name, _digest(secret), secret[-4:]), {"secret": secret, "shared": True}
            )

        def mutate(doc: Any) -> None:
            self._find(doc, name)["secret"] = secret

        return mutate, {"secret": secret}

    def remove(self, name: str) -> tuple[Callable[[Any], None], dict[str, Any]] | SharedChange:
        """
        Remove the key C{name}, where it is (the config file, else the
        shared store), unless it is the last unscoped key while scoped keys
        remain, of either kind.
        """
        shared = self._shared
        if shared is not None and not self._in_file(name):
            local = (*self.config.keys, *self._extra)
            unscoped, scoped = any(k.admin for k in local), any(not k.admin for k in local)
            return SharedChange(lambda: shared.remove(name, unscoped, scoped), {"name": name})
        others = [s.key for s in self.shared]

        def mutate(doc: Any) -> None:
            keys = doc.get("keys", [])
            target = self._find(doc, name)
            rest = [t for t in keys if t is not target]
            unscoped_left = any(not t.get("models") for t in rest) or any(k.admin for k in others)
            if not target.get("models") and (rest or others) and not unscoped_left:
                raise ConfigError(
                    f"{name!r} is the last unscoped key and scoped keys remain: nobody could "
                    "manage them; add another unscoped key first (`blazar keys add NAME`)"
                )
            keys.remove(target)
            if not keys:
                del doc["keys"]

        return mutate, {"name": name}
