"""
Changing API keys at runtime: the config file is the source of truth, so
every change goes parse → change → validate → atomic write (with a .bak),
under one lock, off the reactor thread; only then is the live config
(L{blazar.config.LiveConfig}) swapped. A failed validation or write changes
nothing, on disk or in memory. C{blazar reload} and SIGHUP go through the
same lock and the same swap.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Any, Callable

from twisted.internet.defer import DeferredLock
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from zope.interface import Attribute, Interface, implementer

from blazar.config import Config, ConfigError, LiveConfig, ReloadReport, load_config, thd_rewrite
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


class IKeyAdmin(Interface):
    """
    Key changes and config reloads, as the control socket asks for them.
    """

    config = Attribute("The live config's current L{Config}.")

    async def change(plan: Callable[[Any], tuple[Callable[[Any], None], dict[str, Any]]]) -> dict[str, Any]:
        """
        Run C{plan(self)}: a change to the config file and the answer; the
        file is rewritten and the live config swapped.
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

    def __init__(self, path: Path | None, live: LiveConfig, reactor: Any) -> None:
        self._path = path
        self._live = live
        self._reactor = reactor
        self._lock = DeferredLock()

    @property
    def config(self) -> Config:
        return self._live.current

    async def change(
        self, plan: Callable[["KeyAdmin"], tuple[Callable[[Any], None], dict[str, Any]]]
    ) -> dict[str, Any]:
        """
        Run C{plan(self)}, which returns (a tomlkit document mutation, the
        answer), through the file round trip, then swap the file's new
        config in whole.

        @raise ConfigError: Invalid change, or the daemon has no config file.
        @raise OSError: The write failed.
        """
        if self._path is None:
            raise ConfigError("this daemon runs without a config file: start it with --config PATH to manage keys")
        await self._lock.acquire()
        try:
            mutate, answer = plan(self)
            config, _ = await deferToThreadPool(
                self._reactor, self._reactor.getThreadPool(), thd_rewrite, self._path, mutate
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

    def add(self, name: str, models: list[str]) -> tuple[Callable[[Any], None], dict[str, Any]]:
        if not KEY_NAME.fullmatch(name):
            raise ConfigError(
                f"a key's name is 1 to 64 letters, digits, '.', '_' or '-' (not {name[:80]!r}): it "
                "appears in logs, metrics and the dashboard"
            )
        secret = new_secret()

        def mutate(doc: Any) -> None:
            import tomlkit

            if any(t.get("name") == name for t in doc.get("keys", [])):
                raise ConfigError(f"a key named {name!r} exists; rotate it or pick another name")
            table = tomlkit.table()
            table["name"] = name
            table["secret"] = secret
            # its own: a key added later under this name (once this one is removed) owns none of its data
            table["id"] = secrets.token_hex(6)
            if models:
                table["models"] = models
            if "keys" not in doc:
                doc["keys"] = tomlkit.aot()
            doc["keys"].append(table)

        return mutate, {"secret": secret}

    def rotate(self, name: str) -> tuple[Callable[[Any], None], dict[str, Any]]:
        secret = new_secret()

        def mutate(doc: Any) -> None:
            self._find(doc, name)["secret"] = secret

        return mutate, {"secret": secret}

    def remove(self, name: str) -> tuple[Callable[[Any], None], dict[str, Any]]:
        def mutate(doc: Any) -> None:
            keys = doc.get("keys", [])
            target = self._find(doc, name)
            rest = [t for t in keys if t is not target]
            if not target.get("models") and rest and not any(not t.get("models") for t in rest):
                raise ConfigError(
                    f"{name!r} is the last unscoped key and scoped keys remain: nobody could "
                    "manage them; add another unscoped key first (`blazar keys add NAME`)"
                )
            keys.remove(target)
            if not keys:
                del doc["keys"]

        return mutate, {"name": name}
